"""The composition matrix: every feature x every parallel mode x {1F1B, ZBV}, each cell exact or refused.

A cell is one ``dynmo-train`` run of gpt_tiny on real gloo processes. It is *exact* when its losses (every step) and
its final model are within 1e-5 relative of one process running the same feature (fp32) and the feature visibly
happened (layers moved, the world shrank, ...); *refused* when the launching process refuses its settings before any
worker starts (the message and its row of docs/errors.md are recorded); anything else is *differs* or *fails* (with
the log's tail), which the test of the committed file does not accept.

Run (about 15 minutes on 2 cores)::

    PYTHONPATH=tests python -m support.composition --out docs/bench/composition.json --docs docs/scale_out.md

``--modes`` / ``--features`` run part of it (and print without ``--out``). ``tests/test_composition.py`` checks the
committed file: every cell exact or refused, the refusals still those of today's pre-launch checks, and the table in
docs/scale_out.md rendered from it; the slow lane runs cells again and compares them with the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from support.helpers import DP2, EPOCH, FREEZE, RANDOM, TINY, ZBV, CliRun, launch

COMMAND = "PYTHONPATH=tests python -m support.composition --out docs/bench/composition.json --docs docs/scale_out.md"
ROOT = Path(__file__).resolve().parents[2]
ERRORS = ROOT / "docs" / "errors.md"
RTOL = 1e-5

#: The columns: how each mode splits a job of 4 processes (8 for fsdp x T = 2) around a pipeline of P = 2.
TP2 = ["strategy.tensor_parallel_size=2"]
MODES: dict[str, tuple[int, list[str]]] = {
    "ddp D=2": (4, [*DP2, "strategy.data_parallel=ddp"]),
    "fsdp D=2": (4, [*DP2, "strategy.data_parallel=fsdp"]),
    "replicate D=2": (4, [*DP2, "strategy.data_parallel=replicate"]),
    "T=2": (4, TP2),
    "fsdp D=2 x T=2": (8, [*DP2, "strategy.data_parallel=fsdp", *TP2]),
}
SCHEDULES: dict[str, list[str]] = {"1F1B": [], "ZBV": ZBV}

STEPS = ["trainer.max_steps=12"]
#: Consolidation from P = 2 onto one stage once layers 0-3 froze (injected costs: a decision, not a timing).
REPACK_P2 = [
    "balancer=optimal",
    "balancer.every_n_steps=5",
    "balancer.warmup_steps=2",
    "balancer.repack=true",
    "balancer.repack_tolerance=1.0",
    "balancer.min_stages=1",
]
PRUNE = ["dynamics=pruning", "dynamics.start_step=2", "dynamics.end_step=10", "dynamics.every_n_steps=2"]


def _moved(run: CliRun) -> bool:
    return len({tuple(p["layers_per_stage"]) for p in run.summary["partitions"]}) >= 2


def _changed(run: CliRun) -> bool:
    return bool(run.summary["layers_changed"])


def _zeroed(run: CliRun) -> bool:
    """Masks zeroed weights (unstructured pruning changes no shape)."""
    return sum(int((t == 0).sum()) for t in run.checkpoint["state_dict"].values()) > 0


def _sizes(summary: dict[str, Any]) -> list[int]:
    return [w["world_size"] for w in summary["world_size"]]


def _shrank(run: CliRun) -> bool:
    sizes = _sizes(run.summary)
    return len(sizes) >= 2 and sizes[-1] < sizes[0]


def _replicas_grew(run: CliRun) -> bool:
    replicas = [w["replicas"] for w in run.summary["world_size"]]
    return len(replicas) >= 2 and replicas[-1] > replicas[0] and _sizes(run.summary)[-1] == _sizes(run.summary)[0]


def _grew_back(run: CliRun) -> bool:
    sizes = _sizes(run.summary)
    return len(sizes) == 3 and sizes[0] == sizes[2] > sizes[1]


@dataclasses.dataclass(frozen=True)
class Feature:
    """A row: its settings, what one process runs to compare with, and what shows it happened.

    Attributes:
        overrides: the feature's settings (every mode's cell adds its own).
        reference: one process's settings for the same math (the feature without what only moves layers).
        happened: reads the cell's run: did the feature act (layers moved, the world shrank, ...).
        alone: the cell changes its world, so it runs in a launch of its own (released processes leave).
        inject_costs: the balancer plans from structural costs (``support.injected_costs``), not timings.
        load_rises_at: from this step on, the injected load rises again (growing back).
        resume: the cell is a run to step 10 that writes a checkpoint, resumed to step 12 in the same mode.
    """

    overrides: list[str]
    reference: list[str]
    happened: Callable[[CliRun], bool] | None = None
    alone: bool = False
    inject_costs: bool = False
    load_rises_at: int | None = None
    resume: bool = False


SGD = ["model._target_=support.sgd_gpt.SGDGPT", "trainer.gradient_clip_val=null"]
EXIT = ["dynamics=early_exit", "dynamics.warmup_steps=3", "dynamics.ramp_steps=3", "dynamics.threshold=0.6"]
MOD = ["dynamics=mod", "dynamics.start_step=2", "dynamics.anneal_steps=6"]
SPARSE = ["dynamics=sparse_attention", "dynamics.attn_block=8", "dynamics.target_coverage=0.8"]
# Dropless and without the load-balancing loss: routing per token, so replicas of half the batch compute what one
# process does (capacity and the balancing loss are statistics of each replica's micro-batch, as batch norm's are).
MOE = ["dynamics=moe", "dynamics.n_experts=4", "dynamics.every=2", "dynamics.capacity_factor=null",
       "dynamics.aux_loss_coef=0"]  # fmt: skip
STRUCTURED = [*PRUNE, "dynamics.mode=structured", "dynamics.multiple_of=2"]
# Magnitude masks are discontinuous in the weights: an entry within float noise of the threshold falls on either side
# under another summation order (replicas, tensor-parallel sums), and AdamW amplifies that noise where gradients are
# near zero (one entry of 4096 flipped at T = 2, then the runs part). Under plain SGD the noise stays at rounding.
UNSTRUCTURED = [*PRUNE, "dynamics.mode=unstructured", *SGD]
DIFFUSION = ["balancer=diffusion", "balancer.every_n_steps=4", "balancer.warmup_steps=1", "balancer.min_gain=0.02"]
GROW = [*REPACK_P2, "balancer.repack_tolerance=0.15", "balancer.on_release=wait"]

FEATURES: dict[str, Feature] = {
    "layers moving (a random split every 5 steps)": Feature([*STEPS, *RANDOM], STEPS, _moved),
    "plain SGD, no clipping, layers moving": Feature([*STEPS, *SGD, *RANDOM], [*STEPS, *SGD], _moved),
    "freezing, layers moving": Feature([*STEPS, *FREEZE, *RANDOM], [*STEPS, *FREEZE], _changed),
    "structured pruning (multiples of 2), layers moving": Feature(
        [*STEPS, *STRUCTURED, *RANDOM], [*STEPS, *STRUCTURED], _changed
    ),
    "unstructured pruning (plain SGD), layers moving": Feature(
        [*STEPS, *UNSTRUCTURED, *RANDOM], [*STEPS, *UNSTRUCTURED], _zeroed
    ),
    "MoE (dropless, no balancing loss), layers moving": Feature([*STEPS, *MOE, *RANDOM], [*STEPS, *MOE], _moved),
    "sparse attention, layers moving": Feature([*STEPS, *SPARSE, *RANDOM], [*STEPS, *SPARSE], _moved),
    "early exit, layers moving": Feature([*STEPS, *EXIT, *RANDOM], [*STEPS, *EXIT], _moved),
    "Mixture of Depths, layers moving": Feature([*STEPS, *MOD, *RANDOM], [*STEPS, *MOD], _moved),
    "diffusion balancing": Feature([*STEPS, *DIFFUSION], STEPS),
    "activation checkpointing, layers moving": Feature(
        [*STEPS, "strategy.activation_checkpointing=all", *RANDOM], STEPS, _moved
    ),
    "consolidation (P = 2 -> 1), released processes exit": Feature(
        ["trainer.max_steps=16", *FREEZE, *REPACK_P2], ["trainer.max_steps=16", *FREEZE], _shrank, True, True
    ),
    "consolidation, released processes become replicas": Feature(
        ["trainer.max_steps=16", *FREEZE, *REPACK_P2, "balancer.on_release=data_parallel", "balancer.min_gain=1.0"],
        ["trainer.max_steps=16", *FREEZE],
        _replicas_grew,
        True,
        True,
    ),
    "shrink, then grow back when the load rises": Feature(
        ["trainer.max_steps=20", *GROW], ["trainer.max_steps=20"], _grew_back, True, True, load_rises_at=10
    ),
    "resume from a checkpoint (step 10 -> 12), layers moving": Feature(
        [*EPOCH, *RANDOM, "trainer.max_steps=10"], [*EPOCH, "trainer.max_steps=12"], resume=True
    ),
}


def _errors_rows() -> dict[int, str]:
    rows = {}
    for line in ERRORS.read_text().splitlines():
        m = re.match(r"\| (\d+) \|", line)
        if m:
            rows[int(m.group(1))] = line
    return rows


def row_of(message: str) -> int | None:
    """The row of docs/errors.md whose abridged error's literal pieces all occur in ``message`` (the first)."""
    for number, row in _errors_rows().items():
        for code in re.findall(r"`([^`]*)`", row.split(" | ")[2]):
            pieces = [f.strip(" ,.'") for f in code.split("...") if len(f.strip(" ,.'")) > 12]
            if pieces and all(p in message for p in pieces):
                return number
    return None


def refusal(overrides: list[str], world: int) -> str | None:
    """What the launching process says of a cell before any worker starts: its message, or None (it would launch).

    Composes the Hydra config as ``dynmo-train`` does, builds the Trainer and runs the strategy's pre-launch checks
    (``strategy.checks.check_job``) with the Trainer call's arguments, in this process.
    """
    from hydra import compose, initialize_config_dir
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    from dynmo_lightning.cli import CONF_DIR, build_callbacks, build_trainer
    from dynmo_lightning.strategy.checks import check_job

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            "config", overrides=[*TINY, *overrides, f"trainer.devices={world}", "run_dir=/tmp/dynmo-composition-check"]
        )
    try:
        model = instantiate(cfg.model, _convert_="all")
        datamodule = instantiate(cfg.data)
        trainer = build_trainer(cfg, build_callbacks(cfg))  # settings a constructor refuses raise here
        check_job(trainer.strategy, trainer, model, None, None, datamodule, None)
    except (ValueError, InstantiationException) as e:
        return " ".join(str(e.__cause__ if isinstance(e, InstantiationException) else e).split())
    return None


def _cell_overrides(feature: Feature, mode: str, schedule: str) -> list[str]:
    return [*MODES[mode][1], *SCHEDULES[schedule], *feature.overrides]


def _compare(run: CliRun, ref: CliRun, before: list[float]) -> dict[str, float]:
    """Largest per-step relative loss difference and the final model's relative difference (whole vector).

    ``before``: the losses of the run a resumed ``run`` continues (its summary has the steps after the resume).
    """
    a, b = [*before, *run.summary["losses"]], ref.summary["losses"]
    if len(a) != len(b):
        return {"loss": float("inf"), "model": float("inf")}
    loss = max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))
    p, q = run.checkpoint["state_dict"], ref.checkpoint["state_dict"]
    if p.keys() != q.keys() or any(p[k].shape != q[k].shape for k in p):
        return {"loss": loss, "model": float("inf")}
    diff = sum(float((p[k].double() - q[k].double()).square().sum()) for k in p) ** 0.5
    norm = sum(float(q[k].double().square().sum()) for k in q) ** 0.5
    return {"loss": loss, "model": diff / norm}


def _launch_isolated(world: int, cases: dict[Path, list[str]], **kw: Any) -> dict[Path, str | None]:
    """Launch ``cases`` together, in order; a failure is the first case without a final checkpoint, and the cases
    after it launch again. Returns the error's tail per case (None: it ran)."""
    try:
        launch(world, cases, **kw)
        return dict.fromkeys(cases)
    except AssertionError as e:
        error = str(e)[-3000:]
    order = list(cases)
    failed = next((i for i, d in enumerate(order) if not (d / "checkpoints" / "final.ckpt").exists()), len(order) - 1)
    out: dict[Path, str | None] = dict.fromkeys(order[:failed])
    out[order[failed]] = error
    rest = {d: cases[d] for d in order[failed + 1 :]}
    return out | (_launch_isolated(world, rest, **kw) if rest else {})


def run_matrix(work: Path, modes: list[str], features: list[str]) -> list[dict[str, Any]]:
    """Run (or refuse) every cell of ``modes`` x ``features`` x the schedules; one dict per cell."""
    cells: list[dict[str, Any]] = []
    planned: dict[tuple[str, str, str], tuple[Path, list[str]]] = {}
    for mode in modes:
        world = MODES[mode][0]
        for schedule in SCHEDULES:
            for name in features:
                feature = FEATURES[name]
                overrides = _cell_overrides(feature, mode, schedule)
                cell = {"feature": name, "mode": mode, "schedule": schedule, "world": world}
                message = refusal(overrides, world)
                if message is not None:
                    cells.append({**cell, "verdict": "refused", "row": row_of(message), "message": message})
                    continue
                slug = re.sub(r"[^a-z0-9]+", "-", f"{mode}-{schedule}-{name}".lower()).strip("-")[:80]
                planned[(name, mode, schedule)] = (work / slug, overrides)
                cells.append(cell)
    refs = {name: work / f"ref-{i}" for i, name in enumerate(features)}
    launch(1, {refs[name]: FEATURES[name].reference for name in features})
    errors: dict[Path, str | None] = {}
    result: dict[tuple[str, str, str], Path] = {key: d for key, (d, _) in planned.items()}
    for mode in modes:
        world = MODES[mode][0]
        mine = {key: v for key, v in planned.items() if key[1] == mode}
        together = {d: o for (name, _, _), (d, o) in mine.items() if not FEATURES[name].alone}
        if together:
            errors |= _launch_isolated(world, together)
        for key, (d, o) in mine.items():
            feature = FEATURES[key[0]]
            if feature.alone:
                kw = {"inject_costs": feature.inject_costs, "load_rises_at": feature.load_rises_at}
                errors |= _launch_isolated(world, {d: o}, **kw)
            if feature.resume and errors.get(d) is None:
                resumed = result[key] = d.with_name(d.name + "-resumed")
                ckpt = f"ckpt_path={d / 'checkpoints' / 'last.ckpt'}"
                errors |= _launch_isolated(world, {resumed: [*o, "trainer.max_steps=12", ckpt]})
    for cell in cells:
        if "verdict" in cell:
            continue
        name, mode, schedule = cell["feature"], cell["mode"], cell["schedule"]
        d = result[(name, mode, schedule)]
        first = planned[(name, mode, schedule)][0]
        failed = errors.get(first) or errors.get(d)
        if failed is not None:
            cell |= {"verdict": "fails", "log": failed}
            continue
        run, ref = CliRun(d), CliRun(refs[name])
        diff = _compare(run, ref, CliRun(first).summary["losses"] if first != d else [])
        happened = FEATURES[name].happened
        acted = happened is None or happened(run)
        exact = diff["loss"] <= RTOL and diff["model"] <= RTOL
        cell |= {
            "verdict": "exact" if exact and acted else ("did not act" if exact else "differs"),
            "loss_rel": diff["loss"],
            "model_rel": diff["model"],
            "world_sizes": _sizes(run.summary),
            "partitions": [p["layers_per_stage"] for p in run.summary["partitions"]],
        }
    return cells


BEGIN, END = "<!-- composition matrix: begin -->", "<!-- composition matrix: end -->"


def _mark(cell: dict[str, Any]) -> str:
    if cell["verdict"] == "refused":
        return f"refused (row {cell['row']})"
    return cell["verdict"]


def table(cells: list[dict[str, Any]]) -> str:
    """The matrix as the Markdown table docs/scale_out.md shows: a row per feature, a column per mode.

    A cell reads "1F1B / ZBV" when the schedules differ, or once when they agree.
    """
    modes = list(dict.fromkeys(c["mode"] for c in cells))
    features = list(dict.fromkeys(c["feature"] for c in cells))
    at = {(c["feature"], c["mode"], c["schedule"]): _mark(c) for c in cells}
    lines = [f"| feature | {' | '.join(modes)} |", f"| --- |{' --- |' * len(modes)}"]
    for name in features:
        marks = []
        for mode in modes:
            both = [at[(name, mode, schedule)] for schedule in SCHEDULES]
            marks.append(both[0] if len(set(both)) == 1 else " / ".join(both))
        lines.append(f"| {name} | {' | '.join(marks)} |")
    return "\n".join(lines)


def write_docs(doc: Path, cells: list[dict[str, Any]]) -> None:
    """Replace the generated table between the markers in ``doc``."""
    text = doc.read_text()
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    doc.write_text(f"{head}{BEGIN}\n{table(cells)}\n{END}{tail}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="write the matrix here (JSON)")
    parser.add_argument("--docs", type=Path, help="rewrite the generated table of this page (docs/scale_out.md)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/dynmo-composition"))
    parser.add_argument("--modes", nargs="*", default=list(MODES))
    parser.add_argument("--features", nargs="*", default=list(FEATURES))
    args = parser.parse_args(argv)
    started = time.time()
    cells = run_matrix(args.work, args.modes, args.features)
    revision = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, cwd=ROOT)
    result = {
        "command": COMMAND,
        "torch": torch.__version__,
        "revision": revision.stdout.strip(),
        "seconds": round(time.time() - started),
        "rtol": RTOL,
        "cells": cells,
    }
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    if args.docs:
        write_docs(args.docs, cells)
    for cell in cells:
        print(cell["verdict"], cell["mode"], cell["schedule"], cell["feature"], cell.get("row", ""),
              f"{cell.get('loss_rel', '')}", f"{cell.get('model_rel', '')}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
