"""A small Llama-shaped Hugging Face model trained as a pipeline, with layer freezing and the DynMo balancer.

Run:  python examples/train_hf_llama.py --devices 2 --max-steps 200        (needs `pip install '.[hf]'`)

The model is built from a ``transformers`` config (random initialisation, no download) and handed to ``from_hf``,
which splits it into pipeline layers: embedding, each decoder layer, final norm + head. ``LayerFreezing`` freezes a
growing prefix of layers as their gradients settle, which leaves the first stage with little work; ``DynMoBalancer``
measures the layers and moves them so the stages even out again. At the end the trained model is written back as a
Hugging Face checkpoint (``--export DIR``), which ``AutoModelForCausalLM.from_pretrained(DIR)`` loads.
"""

import argparse

import lightning.pytorch as L
import torch.distributed as dist

from dynmo_lightning import DynMoBalancer, DynMoStrategy
from dynmo_lightning.callbacks import LayerFreezing
from dynmo_lightning.cli import export
from dynmo_lightning.data import VOCAB_SIZE, StdlibCharDataModule
from dynmo_lightning.models.hf import from_hf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=2, help="pipeline processes (CPU ranks)")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--export", default=None, help="write the trained model here with save_pretrained")
    args = parser.parse_args()

    L.seed_everything(0)  # the same data order in every process
    data = StdlibCharDataModule(block_size=64, batch_size=32, max_val_batches=8)
    config = {  # a transformers LlamaConfig (or a loaded model) works the same way
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,  # byte-level corpus of the Python standard library's sources
        "hidden_size": 128,
        "intermediate_size": 344,
        "num_hidden_layers": args.layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,  # grouped-query attention
        "max_position_embeddings": 64,
    }
    # From a config no process builds the whole model: each stage initialises only its own layers, layer i from its
    # own seed (derived from `seed`), so the weights are those a single process would build.
    model = from_hf(config, lr=3e-3, weight_decay=0.1, seed=0)

    callbacks = [
        LayerFreezing(mode="auto", start_step=20, check_every_n_steps=20, max_frozen_fraction=0.5),
        DynMoBalancer(method="optimal", every_n_steps=20, warmup_steps=5),
    ]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=DynMoStrategy(n_microbatches=4, schedule="1f1b"),
        max_steps=args.max_steps,
        val_check_interval=100,
        limit_val_batches=8,
        gradient_clip_val=1.0,
        num_sanity_val_steps=0,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(model, datamodule=data)
    if trainer.is_global_zero:
        print({k: round(float(v), 4) for k, v in trainer.callback_metrics.items()})
        print("layers per stage over training:", trainer.strategy.pipeline_control.partitions)
    if args.export:
        # Every stage writes its own layers; then one process reads them all back (what `dynmo-export --hf` does).
        trainer.save_checkpoint(f"{args.export}.ckpt", weights_only=False)
        rank0 = trainer.is_global_zero
        if dist.is_initialized():
            dist.destroy_process_group()  # the export reads the shards on its own, outside the training world
        if rank0:
            export([f"{args.export}.ckpt", args.export, "--hf"])


if __name__ == "__main__":
    main()
