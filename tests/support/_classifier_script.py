"""One rank of a launched job: the classifier of tests/support/classifier_model.py under DynMoStrategy.

Writes the metrics this process ended with to ``OUT_DIR/metrics.rank<R>.json``. Usage:
``PYTHONPATH=tests python tests/support/_classifier_script.py OUT_DIR``.
"""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from dynmo_lightning import DynMoStrategy
from support.classifier_model import run


def main() -> None:
    out, rank = Path(sys.argv[1]), int(os.environ["LOCAL_RANK"])  # one node
    metrics = run(DynMoStrategy(n_microbatches=4, timeout=60), devices=int(os.environ["WORLD_SIZE"]))
    (out / f"metrics.rank{rank}.json").write_text(json.dumps(metrics))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
