"""Pipeline-parallel GPT training from plain Python (no Hydra): Trainer + DynMoStrategy.

Run:  python examples/train_gpt.py --devices 2 --max-steps 200

Lightning's launcher re-runs this script once per extra device, so everything below runs in every process; each
process builds only its own pipeline stage's layers.
"""

import argparse

import lightning.pytorch as L

from dynmo_lightning import DynMoStrategy
from dynmo_lightning.data import StdlibCharDataModule
from dynmo_lightning.models import GPT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=2, help="pipeline processes (CPU ranks)")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()

    L.seed_everything(0)  # same data order and same per-layer initialisation in every process
    data = StdlibCharDataModule(block_size=64, batch_size=32, max_val_batches=8)
    # Layers are created in `configure_model`: on the meta device, then materialised only on their own stage.
    model = GPT(n_layer=4, n_embd=64, n_head=4, block_size=64, warmup_steps=20)

    strategy = DynMoStrategy(
        n_microbatches=args.microbatches,  # the batch of 32 is split into 4 micro-batches of 8
        schedule=args.schedule,  # schedules come from torch.distributed.pipelining
        partition="uniform",  # or "params", or an explicit list like [2, 4]
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.max_steps,
        val_check_interval=100,
        limit_val_batches=8,
        gradient_clip_val=1.0,  # clipped by the norm over all stages, as the unsplit model would
        num_sanity_val_steps=0,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data)
    # `train_loss` and `val_loss`/`val_ppl` are logged by the strategy from the last stage, visible on rank 0.
    if trainer.is_global_zero:
        print({k: round(float(v), 4) for k, v in trainer.callback_metrics.items()})


if __name__ == "__main__":
    main()
