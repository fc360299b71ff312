"""``strategy.compile``: every layer compiled in place trains as eager (P = 2, layers moving every 5 steps), also
under the dynamics and ZBV, and does not recompile step after step.

Compiling is slow on this CPU (tens of seconds per graph), so the blocks are tiny and all cases run in one launch:
the processes keep dynamo's cache from case to case, as a long run would.
"""

from __future__ import annotations

import pytest
from support.helpers import FREEZE, TINY, assert_close_losses, launch

from dynmo_lightning.pipeline.compiled import check_options

STEPS = ["trainer.max_steps=20", "trainer.val_check_interval=null", "trainer.limit_val_batches=0"]
#: A first compile takes minutes on a loaded CPU while the next rank waits in its first receive: a longer timeout.
BASE = [*(o for o in TINY if not o.startswith("strategy.timeout=")), "strategy.timeout=900"]
RANDOM = ["balancer=optimal", "balancer.method=random", "balancer.every_n_steps=5", "balancer.warmup_steps=0"]
DYNAMICS = {
    "none": [],
    "freezing": FREEZE,
    "pruning": ["dynamics=pruning", "dynamics.start_step=2", "dynamics.end_step=12", "dynamics.every_n_steps=5"],
    "early_exit": ["dynamics=early_exit", "dynamics.warmup_steps=2", "dynamics.ramp_steps=4"],
    "moe": ["dynamics=moe", "dynamics.n_experts=4", "dynamics.every=2"],
}
#: Graphs a compiled case may compile in a step after the first, at most (a dynamic's shapes change by design:
#: dynamo makes the changing sizes dynamic after it met two of them).
RECOMPILE_BOUND = {"none": 0, "freezing": 0, "pruning": 0, "early_exit": 4, "moe": 4}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("compiled")
    cases = {}
    for name, dyn in DYNAMICS.items():
        cases[d / f"eager-{name}"] = [*STEPS, *RANDOM, *dyn]
        cases[d / f"compiled-{name}"] = [*STEPS, *RANDOM, *dyn, "strategy.compile=true"]
    zbv = ["strategy.schedule=zbv", "strategy.stages_per_rank=2"]
    cases[d / "eager-zbv"] = [*STEPS, *RANDOM, *zbv]
    cases[d / "compiled-zbv"] = [*STEPS, *RANDOM, *zbv, "strategy.compile=true"]
    out = launch(2, cases, timeout=1700, base=BASE)
    return {path.name: run for path, run in out.items()}


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", [*DYNAMICS, "zbv"])
def test_compiled_layers_train_as_eager_while_they_move(runs, name):
    eager, compiled = runs[f"eager-{name}"].summary, runs[f"compiled-{name}"].summary
    assert len(compiled["partitions"]) >= 3  # moved (and compiled again on arrival)
    assert_close_losses(compiled["losses"], eager["losses"], rtol=1e-4)
    assert sum(eager["compiled_graphs_per_step"]) == 0
    # the cases share one process's cache: the first compiled case compiled the reference GPT's layers
    assert sum(runs["compiled-none"].summary["compiled_graphs_per_step"]) > 0


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", list(DYNAMICS))
def test_compiled_layers_do_not_recompile_every_step(runs, name):
    summary = runs[f"compiled-{name}"].summary
    per_step = summary["compiled_graphs_per_step"]
    # a move or a dynamic that changed layers (frozen, pruned: other shapes) may compile the step after it
    events = {p["step"] for p in summary["partitions"]} | set(summary["layers_changed"])
    later = [n for step, n in enumerate(per_step) if step >= 3 and step not in events]
    assert max(later, default=0) <= RECOMPILE_BOUND[name], per_step


def test_compile_options_are_checked():
    assert check_options(False) is None and check_options(True) == {}
    assert check_options({"mode": "max-autotune"}) == {"mode": "max-autotune"}
    with pytest.raises(ValueError, match=r"strategy.compile has unknown torch.compile options \['modes'\]"):
        check_options({"modes": "x"})
    with pytest.raises(ValueError, match=r"strategy.compile='yes' must be false, true or a dict"):
        check_options("yes")
