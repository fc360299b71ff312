"""One rank of a launched job training the user's model with plain SGD (``support.sgd_model``) under DynMoStrategy.

Usage: ``PYTHONPATH=tests python tests/support/_sgd_script.py OUT_DIR CASE [CASE ...]`` with the distributed
environment set; a case is ``name:key=value,...`` with keys ``dp`` (replicas), ``mode`` (``data_parallel``: ddp,
fsdp, replicate), ``tp`` (processes per stage: the user's tensor-parallel plan), ``batch`` (per replica), ``zbv``
(1: the ZBV schedule, two stages per rank), ``clip`` (``gradient_clip_val``, by norm). Each case writes its
``summary.json`` (losses, pre-clip gradient norms) into ``OUT_DIR/name``.
"""

import os
import sys
from pathlib import Path

import torch.distributed as dist

from dynmo_lightning import DynMoStrategy
from dynmo_lightning.callbacks import RunSummary
from support.sgd_model import train


def main() -> None:
    out = Path(sys.argv[1])
    world_size = int(os.environ["WORLD_SIZE"])  # read once: Lightning's teardown removes it
    for case in sys.argv[2:]:
        name, _, spec = case.partition(":")
        opts = dict(item.split("=") for item in spec.split(",") if item)
        tp = int(opts.get("tp", 1))
        schedule = {"schedule": "zbv", "stages_per_rank": 2} if opts.get("zbv") == "1" else {}
        strategy = DynMoStrategy(
            n_microbatches=4,
            data_parallel_size=int(opts.get("dp", 1)),
            data_parallel=opts.get("mode", "ddp"),
            tensor_parallel_size=tp,
            timeout=60,
            **schedule,
        )
        train(
            strategy,
            devices=world_size,
            batch_size=int(opts.get("batch", 16)),
            clip=float(opts["clip"]) if "clip" in opts else None,
            tp=tp > 1,
            callbacks=[RunSummary(str(out / name))],
        )
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
