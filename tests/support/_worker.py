"""One rank of a multi-process test launch: runs several dynmo-train configurations in the same processes.

Importing Lightning costs seconds per process on the test machines, so a launch of N processes runs a list of cases
back to back (same world, same process group), each through the CLI's own ``run(cfg)`` with a composed Hydra config.
Usage (by tests/support/helpers.py): ``PYTHONPATH=tests python tests/support/_worker.py SPEC.json`` with the
distributed env vars set; with ``"inject_costs": true`` in the spec the balancer sees structural layer costs instead
of timings (``tests/support/injected_costs.py``); with ``"forbid_gathers": true`` every gather collective raises while
the balancer plans (``forbid_gathers``), and each rank writes what its planning runs did to ``planning.rankR.json``.
"""

import contextlib
import functools
import json
import sys
import traceback
from pathlib import Path

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from hydra import compose, initialize_config_dir
from torch.distributed.checkpoint import FileSystemReader

from dynmo_lightning.balance import BalancePolicy
from dynmo_lightning.cli import CONF_DIR, run
from dynmo_lightning.strategy.control import PipelineHandle
from support import injected_costs

READ_BYTES = [0]
GATHERS = ("all_gather_object", "all_gather", "gather", "gather_object", "all_gather_into_tensor")
PLANNING: list[dict] = []


@contextlib.contextmanager
def _no_gathers():
    """Every gather collective raises inside (on torch.distributed and where it is defined)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a gather collective was called while the balancer planned")

    saved = [(m, n, getattr(m, n)) for m in (dist, c10d) for n in GATHERS]
    for module, name, _ in saved:
        setattr(module, name, refuse)
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def forbid_gathers() -> None:
    """The balancer's planning (the neighbour protocol and the decision) runs with every gather refused."""
    run_neighbours, decide = PipelineHandle.run_neighbours, BalancePolicy.decide

    @functools.wraps(run_neighbours)
    def neighbours(self, stage_of):
        with _no_gathers():
            stats = run_neighbours(self, stage_of)
        PLANNING.append({"rounds": stats.rounds, "probes": stats.probes, "split": stats.layers_per_stage})
        return stats

    @functools.wraps(decide)
    def decided(self, *args, **kwargs):
        with _no_gathers():
            return decide(self, *args, **kwargs)

    PipelineHandle.run_neighbours = neighbours  # type: ignore[method-assign]
    BalancePolicy.decide = decided  # type: ignore[method-assign]


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
        slow = spec.get("slow_process")
        injected_costs.inject(spec.get("load_rises_at"), tuple(slow) if slow else None)
    if spec.get("forbid_gathers"):
        forbid_gathers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for case in spec["cases"]:
            cfg = compose("config", overrides=[*case["overrides"], f"run_dir={case['run_dir']}"])
            READ_BYTES[0] = 0
            try:
                run(cfg)  # a process released by consolidation ends in there (exit status 0)
            except Exception:
                traceback.print_exc()
                sys.exit(17)
            if PLANNING and dist.is_initialized():
                planned = Path(case["run_dir"]) / f"planning.rank{dist.get_rank()}.json"
                planned.write_text(json.dumps(PLANNING))
                PLANNING.clear()
            if READ_BYTES[0] and dist.is_initialized():
                reads = Path(case["run_dir"]) / f"reads.rank{dist.get_rank()}.json"
                reads.write_text(json.dumps({"bytes": READ_BYTES[0]}))
    if dist.is_initialized():  # leave the job cleanly: no process group threads alive at interpreter exit
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
