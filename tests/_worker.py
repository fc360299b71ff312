"""One rank of a multi-process test launch: runs several dynmo-train configurations in the same processes.

Importing Lightning costs seconds per process on the test machines, so a launch of N processes runs a list of cases
back to back (same world, same process group), each through the CLI's own ``run(cfg)`` with a composed Hydra config.
Usage (by tests/_helpers.py): ``python tests/_worker.py SPEC.json`` with the distributed env vars set; with
``"inject_costs": true`` in the spec the balancer sees structural layer costs instead of timings
(``tests/injected_costs.py``).
"""

import json
import sys
import traceback
from pathlib import Path

import injected_costs
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from torch.distributed.checkpoint import FileSystemReader

from dynmo_lightning.cli import CONF_DIR, run

READ_BYTES = [0]


def record_reads() -> None:
    """Count the bytes this process reads from sharded checkpoints (tests/test_sharded_checkpoints.py)."""
    read = FileSystemReader.read_data

    def read_data(self, plan, planner):  # type: ignore[no-untyped-def]
        READ_BYTES[0] += sum(self.storage_data[item.storage_index].length for item in plan.items)
        return read(self, plan, planner)

    FileSystemReader.read_data = read_data  # type: ignore[method-assign]


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    record_reads()
    if spec.get("inject_costs"):
        injected_costs.inject(spec.get("load_rises_at"))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for case in spec["cases"]:
            cfg = compose("config", overrides=[*case["overrides"], f"run_dir={case['run_dir']}"])
            READ_BYTES[0] = 0
            try:
                run(cfg)  # a process released by consolidation ends in there (exit status 0)
            except Exception:
                traceback.print_exc()
                sys.exit(17)
            if READ_BYTES[0] and dist.is_initialized():
                reads = Path(case["run_dir"]) / f"reads.rank{dist.get_rank()}.json"
                reads.write_text(json.dumps({"bytes": READ_BYTES[0]}))
    if dist.is_initialized():  # leave the job cleanly: no process group threads alive at interpreter exit
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
