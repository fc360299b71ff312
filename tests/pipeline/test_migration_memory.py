"""What a migration holds on the way, counted by a counter that sees DTensors' local tensors.

Two layers arrive on one pipeline rank from both sides (P = 3, under fsdp and replicate with D = 2 and under tensor
parallelism with T = 2): a received part becomes its parameter or optimizer state (no copy into a fresh
allocation), every gradient is dropped before anything travels, and a layer that left is freed at the commit, the
units it ran with included (``StageSharding.forget_root``). So no process holds more during the move than the larger
of what it held before and after, beyond the one buffer of small tensors travelling together.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.helpers import launch_script
from support.memory import PeakBytes
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from dynmo_lightning.pipeline.topology.transport import COALESCE_BELOW

SUPPORT = Path(__file__).resolve().parents[1] / "support"
MODES = ("fsdp", "replicate", "tp")


@pytest.fixture(scope="module")
def moved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    d = tmp_path_factory.mktemp("migration_memory")
    launch_script(6, SUPPORT / "_migration_memory_script.py", str(d / "out"), *MODES, log_dir=d / "logs")
    return {m: [json.loads((d / f"out.{m}.rank{r}.json").read_text()) for r in range(6)] for m in MODES}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", MODES)
def test_two_arriving_layers_cost_what_arrives_and_nothing_more(moved: dict[str, list[dict]], mode: str) -> None:
    for rank in moved[mode]:
        assert rank["after"] == rank["held_after"]  # what left is freed: the counter ends at what the rank holds
        if rank["pp_rank"] == 1:  # two layers arrived: their parameters' and optimizer state's parts
            assert rank["arrived_layers"] == 2 and rank["arrived_bytes"] > 0.4 * rank["after"]
        # the larger steady state, plus at most the coalesced small tensors of one message
        assert rank["peak"] - max(rank["before"], rank["after"]) < COALESCE_BELOW, rank


def test_the_counter_sees_the_local_tensors_of_dtensors() -> None:
    """A DTensor's ``to_empty`` allocates only its local tensor, which a count of plain tensors never sees."""
    from torch.distributed.device_mesh import init_device_mesh

    from dynmo_lightning.launch import fresh_world

    with fresh_world():
        torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        mesh = init_device_mesh("cpu", (1,))
        with torch.device("meta"):
            layer = nn.Sequential(nn.Linear(256, 256))
        parallelize_module(layer, mesh, {"0": ColwiseParallel()})
        assert isinstance(layer[0].weight, DTensor)
        with PeakBytes() as counter:
            layer.to_empty(device="cpu")
        assert counter.peak == (256 * 256 + 256) * 4
