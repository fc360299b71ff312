"""One rank of a launched job training the user's model (tests/support/user_model.py) under DynMoStrategy, case by case.

Usage: ``PYTHONPATH=tests python tests/support/_user_script.py OUT_DIR CASE [CASE ...]`` with the distributed
environment set; a case is ``name:key=value,...`` with keys ``dp`` (replicas), ``tp`` (processes per stage: the
user's tensor-parallel plan), ``batch`` (per replica), ``shuffle`` (0/1), ``random`` (1: the balancer moves layers to
a random split every 3 steps).
"""

import os
import sys
from pathlib import Path

import torch.distributed as dist

from dynmo_lightning import DynMoBalancer, DynMoStrategy
from support.user_model import fit, save


def main() -> None:
    out = Path(sys.argv[1])
    world_size = int(os.environ["WORLD_SIZE"])  # read once: Lightning's teardown removes it
    for case in sys.argv[2:]:
        name, _, spec = case.partition(":")
        opts = {k: int(v) for k, v in (item.split("=") for item in spec.split(",") if item)}
        callbacks = []
        if opts.get("random"):
            callbacks.append(DynMoBalancer(method="random", every_n_steps=3, warmup_steps=0))
        tp = opts.get("tp", 1)
        strategy = DynMoStrategy(
            n_microbatches=4, data_parallel_size=opts.get("dp", 1), tensor_parallel_size=tp, timeout=60
        )
        result = fit(
            strategy,
            devices=world_size,
            batch_size=opts.get("batch", 16),
            shuffle=bool(opts.get("shuffle", 0)),
            callbacks=callbacks,
            tp=tp > 1,
        )
        save(result, out / f"{name}.json")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
