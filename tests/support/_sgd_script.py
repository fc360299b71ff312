"""One rank of a launched job training the user's model with plain SGD (``support.sgd_model``) under DynMoStrategy.

Usage: ``PYTHONPATH=tests python tests/support/_sgd_script.py OUT_DIR CASE [CASE ...]`` with the distributed
environment set; a case is ``name:key=value,...`` with keys ``dp`` (replicas), ``mode`` (``data_parallel``: ddp,
fsdp, replicate), ``memory`` (``fsdp_memory``: fast, lean), ``tp`` (processes per stage: the user's tensor-parallel
plan), ``batch`` (per replica), ``zbv``
(1: the ZBV schedule, two stages per rank), ``clip`` (``gradient_clip_val``, by norm), ``auto`` (1: ``fsdp_memory=
"auto"`` under DynMo's balancer, whose memory capacity :class:`Squeeze` sets between the fast and the lean way's
least peaks from step 2 to 5: the units run lean in between, fast before and after). Each case writes its
``summary.json`` (losses, pre-clip gradient norms) into ``OUT_DIR/name``, and ``ways.json`` (the way FSDP2 units
ran every step).
"""

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch.distributed as dist

from dynmo_lightning import DynMoBalancer, DynMoStrategy
from dynmo_lightning.balance.steptime.memory_model import MemoryModel
from dynmo_lightning.callbacks import RunSummary
from support.sgd_model import train


class Squeeze(L.Callback):
    """Sets the balancer's memory capacity between the least peaks of the fast and the lean way, steps 2 to 5.

    The capacity is derived from the balancer's own measured layer bytes (deterministic: sizes, not timings); from
    step 6 on it is unlimited again. Records the way the units ran at every step.
    """

    def __init__(self, balancer: DynMoBalancer, out: Path) -> None:
        self.balancer, self.out, self.ways = balancer, out, []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        self.ways.append(trainer.strategy.pipeline_control.fsdp_memory_in_force)
        policy, step = self.balancer.policy, trainer.global_step
        if step == 2:
            assert policy.tracker is not None and policy.tracker.samples, "the balancer measured nothing yet"
            fast, lean = (_least_peak(policy.tracker.layer_memory(way), trainer.strategy) for way in ("fast", "lean"))
            assert lean < fast, (lean, fast)
            self._set(policy, (fast + lean) / 2)
        if step == 6:
            self._set(policy, 1e15)

    @staticmethod
    def _set(policy: Any, capacity: float) -> None:
        policy.settings = dataclasses.replace(policy.settings, memory_capacity=capacity)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 0:
            (self.out / "ways.json").write_text(json.dumps(self.ways))


def _least_peak(layers: list[Any], strategy: Any) -> float:
    """The least, over the splits into two stages, of the highest rank's predicted peak."""
    model = MemoryModel(layers, strategy.schedule, strategy.pipeline_control.pp_size, strategy.n_microbatches)
    return min(max(model.peaks([k, len(layers) - k])) for k in range(1, len(layers)))


def main() -> None:
    out = Path(sys.argv[1])
    world_size = int(os.environ["WORLD_SIZE"])  # read once: Lightning's teardown removes it
    for case in sys.argv[2:]:
        name, _, spec = case.partition(":")
        opts = dict(item.split("=") for item in spec.split(",") if item)
        tp = int(opts.get("tp", 1))
        schedule = {"schedule": "zbv", "stages_per_rank": 2} if opts.get("zbv") == "1" else {}
        callbacks: list[L.Callback] = [RunSummary(str(out / name))]
        if opts.get("auto") == "1":
            balancer = DynMoBalancer(every_n_steps=2, warmup_steps=1, memory_capacity=1e15)
            callbacks += [Squeeze(balancer, out / name), balancer]
        strategy = DynMoStrategy(
            n_microbatches=4,
            data_parallel_size=int(opts.get("dp", 1)),
            data_parallel=opts.get("mode", "ddp"),
            fsdp_memory="auto" if opts.get("auto") == "1" else opts.get("memory", "fast"),
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
            callbacks=callbacks,
        )
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
