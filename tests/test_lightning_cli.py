"""LightningCLI builds every component from ``class_path`` + ``init_args``, and type checkers read their settings.

The components' signatures are their settings dataclasses' fields (``dynmo_lightning.settings.configured_by``):
jsonargparse reads them at run time, mypy through a ``ParamSpec``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from lightning.pytorch.cli import LightningCLI
from support import SUPPORT
from support.helpers import assert_close_losses, launch_script
from support.user_model import STEPS, UserNet, fit

from dynmo_lightning import DynMoBalancer, DynMoStrategy
from dynmo_lightning.callbacks import (
    DynamicSparseAttention,
    GradualPruning,
    LayerFreezing,
    MixtureOfDepths,
    MixtureOfExperts,
    TokenEarlyExit,
)

SCRIPT = SUPPORT / "_cli_script.py"
ROOT = Path(__file__).resolve().parents[1]

#: The issue's config, as a LightningCLI user writes it (docs/usage.md shows the same).
TRAINER = {"accelerator": "cpu", "devices": 2, "max_steps": STEPS, "logger": False, "enable_checkpointing": False,
           "enable_progress_bar": False, "enable_model_summary": False, "gradient_clip_val": 0.5}  # fmt: skip
STRATEGY = {
    "class_path": "dynmo_lightning.DynMoStrategy",
    "init_args": {"n_microbatches": 4, "schedule": "zbv", "stages_per_rank": 2, "timeout": 60},
}
BALANCER = {
    "class_path": "dynmo_lightning.DynMoBalancer",
    "init_args": {"every_n_steps": 5, "warmup_steps": 0, "method": "random"},  # layers move every 5 steps
}

#: Every dynamics callback with settings other than its defaults (what the parsed object must carry).
DYNAMICS = {
    LayerFreezing: {"mode": "schedule", "schedule": {0: 3, 1: 5}, "start_step": 2},
    GradualPruning: {"final_sparsity": 0.5, "mode": "structured", "end_step": 30},
    TokenEarlyExit: {"threshold": 0.8, "min_layers": 2, "log_every_n_steps": 3},
    MixtureOfDepths: {"capacity": 0.25, "every": 3},
    MixtureOfExperts: {"n_experts": 8, "top_k": 2, "capacity_factor": None},
    DynamicSparseAttention: {"density": 0.5, "attn_block": 16},
}


def _class_path(cls: type) -> str:
    return f"dynmo_lightning.callbacks.{cls.__name__}"


def test_lightning_cli_builds_every_component_from_class_path_and_init_args(tmp_path):
    callbacks = [BALANCER, *({"class_path": _class_path(c), "init_args": a} for c, a in DYNAMICS.items())]
    config = tmp_path / "config.yaml"
    trainer = {**TRAINER, "devices": 1, "strategy": STRATEGY, "callbacks": callbacks}
    config.write_text(yaml.safe_dump({"trainer": trainer}))
    cli = LightningCLI(UserNet, args=["--config", str(config)], run=False, save_config_callback=None)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, DynMoStrategy)
    assert (strategy.settings.schedule, strategy.settings.stages_per_rank, strategy.settings.timeout) == ("zbv", 2, 60)
    built = {type(c): c for c in cli.trainer.callbacks}
    assert built[DynMoBalancer].settings.method == "random" and built[DynMoBalancer].settings.every_n_steps == 5
    for cls, args in DYNAMICS.items():
        assert {k: getattr(built[cls].settings, k) for k in args} == args, cls.__name__


def test_lightning_cli_takes_the_registered_strategy_name(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"trainer": {**TRAINER, "devices": 1, "strategy": "dynmo"}}))
    cli = LightningCLI(UserNet, args=["--config", str(config)], run=False, save_config_callback=None)
    assert isinstance(cli.trainer.strategy, DynMoStrategy)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_lightning_cli_trains_two_ranks_as_plain_lightning_does(tmp_path):
    reference = fit()["losses"]  # plain Lightning, one device
    runs = {
        "zbv-moving": {**TRAINER, "strategy": STRATEGY, "callbacks": [BALANCER]},
        "by-name": {**TRAINER, "strategy": "dynmo"},
    }
    for name, trainer in runs.items():
        config = tmp_path / f"{name}.yaml"
        config.write_text(yaml.safe_dump({"trainer": trainer}))
        launch_script(2, SCRIPT, str(config), str(tmp_path / f"{name}.json"), log_dir=tmp_path / "logs")
        result = json.loads((tmp_path / f"{name}.json").read_text())
        assert result["built"][0] == "DynMoStrategy", result["built"]
        assert len(result["losses"]) == STEPS
        assert_close_losses(result["losses"], reference)
    balancer = json.loads((tmp_path / "zbv-moving.json").read_text())["settings"]["DynMoBalancer"]
    assert balancer["method"] == "random" and balancer["every_n_steps"] == 5


#: Calls a type checker must refuse (the line's expected mypy error code) or accept (no code).
TYPED_CALLS = {
    "DynMoBalancer(every_n_steps=3, repack=True)": None,
    "DynMoBalancer(every_n_step=3)": "call-arg",
    "DynMoBalancer(every_n_steps='3')": "arg-type",
    "DynMoStrategy(n_microbatches=8, schedule='zbv', stages_per_rank=2)": None,
    "DynMoStrategy(n_microbatch=8)": "call-arg",
    "DynMoStrategy(n_microbatches=8.5)": "arg-type",
    "MixtureOfExperts(n_experts=8)": None,
    "MixtureOfExperts(n_expert=8)": "call-arg",
    "LayerFreezing(start_setp=3)": "call-arg",
    "GradualPruning(final_sparsity='high')": "arg-type",
    "TokenEarlyExit(treshold=0.5)": "call-arg",
    "MixtureOfDepths(capacity=None)": "arg-type",
    "DynamicSparseAttention(densty=0.5)": "call-arg",
    "DynMoBalancer.from_settings(BalancerSettings(every_n_steps=3))": None,
    "DynMoBalancer.from_settings(StrategySettings())": "arg-type",
}


@pytest.mark.timeout(300)
def test_type_checkers_flag_a_misspelt_setting_and_a_wrong_type(tmp_path):
    pytest.importorskip("mypy")
    lines = [
        "from dynmo_lightning import BalancerSettings, DynMoBalancer, DynMoStrategy, StrategySettings",
        "from dynmo_lightning.callbacks import (DynamicSparseAttention, GradualPruning, LayerFreezing,",
        "    MixtureOfDepths, MixtureOfExperts, TokenEarlyExit)",
        *TYPED_CALLS,
    ]
    snippet = tmp_path / "calls.py"
    snippet.write_text("\n".join(lines) + "\n")
    # Only this package is analysed: torch and Lightning are skipped (seconds instead of a minute, same verdicts).
    config = tmp_path / "mypy.ini"
    config.write_text(textwrap.dedent("""\
        [mypy]
        follow_imports = silent
        ignore_missing_imports = True
        cache_dir = /dev/null
        [mypy-torch.*,lightning.*,lightning_fabric.*,pytorch_lightning.*,lightning_utilities.*,numpy.*,transformers.*,hydra.*,omegaconf.*,matplotlib.*,torchmetrics.*,typing_extensions.*]
        follow_imports = skip
        """))  # fmt: skip
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(config), str(snippet)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280)
    found = {int(n): code for n, code in re.findall(r"calls\.py:(\d+): error: .*\[([\w-]+)\]", done.stdout)}
    first = len(lines) - len(TYPED_CALLS) + 1
    expected = {first + i: code for i, code in enumerate(TYPED_CALLS.values()) if code}
    assert found == expected, done.stdout
    assert (ROOT / "dynmo_lightning" / "py.typed").exists()  # installed, the package says it is typed
