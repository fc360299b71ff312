"""Host reads and host-to-device copies per training step, per dynamic: the table of ``docs/host_syncs.md``.

    python examples/count_syncs.py --out docs/bench/host_syncs.json                 # DP = 2 and PP = 2, every dynamic
    python examples/count_syncs.py --layouts dp2 --dynamics none,early_exit   # a part

Every case trains the reference GPT (4 blocks, 2 micro-batches per replica, clipping by the global norm on) on two
CPU processes, as two data-parallel replicas of one stage (``dp2``) or as a pipeline of two stages (``pp2``), with
:class:`~dynmo_lightning.callbacks.HostSyncCounter` on each process: reads of tensor values (``item``, ``tolist``,
``bool``, ...), data-dependent operators (boolean-mask indexing, ``nonzero``, ...) and tensors made from Python data
(``torch.tensor(list)``: a pageable copy on an accelerator), Lightning's own and the optimizer step's left out. A step
is *steady* when nothing happened in it or the step before (no check, prune, freeze or rebuild: the dynamics' event
steps are listed apart). Early exit runs with ``sync="stage"``, what accelerators use.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import lightning.pytorch as L

from dynmo_lightning import DynMoStrategy
from dynmo_lightning.callbacks import (
    DynamicSparseAttention,
    GradualPruning,
    HostSyncCounter,
    LayerFreezing,
    MixtureOfDepths,
    MixtureOfExperts,
    TokenEarlyExit,
)
from dynmo_lightning.data import StdlibCharDataModule
from dynmo_lightning.launch import clean_env
from dynmo_lightning.models import GPT

STEPS, BLOCKS, MICROBATCHES = 12, 4, 2
#: Steps whose reads belong to an event of the dynamic (a check, a prune and the rebuild after it).
DYNAMICS: dict[str, tuple[Any, set[int]]] = {
    "none": (lambda: None, set()),
    "freezing": (lambda: LayerFreezing(mode="auto", check_every_n_steps=4, start_step=0, percentile=90.0), set()),
    "pruning": (lambda: GradualPruning(final_sparsity=0.5, start_step=4, end_step=8, every_n_steps=4), set()),
    "early_exit": (lambda: TokenEarlyExit(threshold=0.5, warmup_steps=0, ramp_steps=0, sync="stage"), set()),
    "mod": (lambda: MixtureOfDepths(capacity=0.25, every=2, start_step=0, anneal_steps=0), set()),
    "moe": (lambda: MixtureOfExperts(n_experts=4, every=2, top_k=1, capacity_factor=1.0), set()),
    "sparse_attention": (lambda: DynamicSparseAttention(attn_block=8, density=0.5, target_coverage=0.9), set()),
}
LAYOUTS = {"dp2": {"data_parallel_size": 2}, "pp2": {"data_parallel_size": 1}}


def run_case(dynamic: str, layout: str, out: Path) -> None:
    """One rank of a case (started by Lightning's launcher for both): writes ``out.rank<R>.json``."""
    L.seed_everything(0)
    model = GPT(n_layer=BLOCKS, n_embd=32, n_head=2, block_size=32, warmup_steps=0, tie_embeddings=False)
    counter = HostSyncCounter()
    make, _ = DYNAMICS[dynamic]
    callbacks = [c for c in (make(), counter) if c is not None]
    strategy = DynMoStrategy(n_microbatches=MICROBATCHES, **LAYOUTS[layout])
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=STEPS, strategy=strategy, callbacks=callbacks,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, gradient_clip_val=0.5)  # fmt: skip
    data = StdlibCharDataModule(block_size=32, batch_size=8, max_bytes=100_000, seed=0)
    with counter.patched():
        trainer.fit(model, datamodule=data)
    rank = trainer.global_rank
    record = {"own": counter.own_counts, "sites": [_short(s) for s in counter.dispatch_sites]}
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(record))


def _short(sites: dict[str, int]) -> dict[str, int]:
    """Call sites relative to the repository (the package's files) or to site-packages."""
    root = str(Path(__file__).resolve().parent.parent) + os.sep

    def short(key: str) -> str:
        what, _, where = key.rpartition(" @ ")
        return f"{what} @ {where.replace(root, '').split('site-packages/')[-1]}"

    return {short(k): v for k, v in sites.items()}


def summarise(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Steady and event steps' counts over the ranks (step 0 and 1 build the stages: left out)."""
    per_step = [max(r["own"][s] for r in ranks) for s in range(len(ranks[0]["own"]))]
    sites: Counter[str] = Counter()
    for r in ranks:
        for step in r["sites"][2:]:
            sites.update({k: v for k, v in step.items() if not k.startswith("[")})
    quiet = [s for s in range(2, len(per_step)) if per_step[s] == 0]
    # Steady: the count most steps have (the dynamic's own per-step reads); events are the steps above it.
    steady = Counter(per_step[2:]).most_common(1)[0][0]
    events = {s: n for s, n in enumerate(per_step) if s >= 2 and n != steady}
    return {"per_step": per_step, "steady": steady, "events": events, "quiet_steps": quiet, "sites": dict(sites)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dynamics", default=",".join(DYNAMICS))
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--out", default="host_syncs.json")
    parser.add_argument("--case", nargs=3, help=argparse.SUPPRESS)  # DYNAMIC LAYOUT OUT: one case, in this process
    args = parser.parse_args()
    if args.case:
        run_case(args.case[0], args.case[1], Path(args.case[2]))
        return
    result: dict[str, Any] = {"steps": STEPS, "blocks": BLOCKS, "microbatches": MICROBATCHES, "cases": {}}
    with tempfile.TemporaryDirectory() as d:
        for layout in args.layouts.split(","):
            for dynamic in args.dynamics.split(","):
                out = Path(d) / f"{layout}-{dynamic}"
                cmd = [sys.executable, __file__, "--case", dynamic, layout, str(out)]
                proc = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True, timeout=600)
                if proc.returncode != 0:
                    raise SystemExit(f"{layout} {dynamic} failed:\n{proc.stderr[-3000:]}")
                ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2)]
                result["cases"][f"{layout}/{dynamic}"] = entry = summarise(ranks)
                print(f"{layout:4s} {dynamic:17s} steady {entry['steady']}  per step {entry['per_step']}", flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
