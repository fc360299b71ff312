"""One source of truth per setting: every Hydra file equals its component's settings, every named key exists."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from dynmo_lightning import DynMoBalancer
from dynmo_lightning.balance import BalancePolicy
from dynmo_lightning.balance.decision.policy_settings import BalanceSettings
from dynmo_lightning.callbacks.balancer import BalancerSettings
from dynmo_lightning.settings import RENAMED

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dynmo_lightning"
CONF = PACKAGE / "conf"
#: Groups whose files instantiate one component each, from its own settings (a file's keys are all of them).
GROUPS = ("balancer", "strategy", "dynamics")
#: A component's arguments that are not settings: Lightning's plugins, handed in by the Trainer.
PLUGINS = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin", "settings"}


def _load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text()) or {}


def _target(name: str) -> type:
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def _settings(cls: type) -> dict[str, Any]:
    """The component's settings and their defaults, as Python and Hydra both see them (its signature)."""
    params = inspect.signature(cls).parameters.values()
    kinds = (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    return {p.name: p.default for p in params if p.name not in PLUGINS and p.kind not in kinds}


def _files(group: str) -> list[Path]:
    return sorted(p for p in (CONF / group).glob("*.yaml") if _load(p).get("_target_"))


@pytest.mark.parametrize("path", [p for g in GROUPS for p in _files(g)], ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_file_spells_every_setting_with_its_default(path: Path):
    raw = _load(path)
    settings = _settings(_target(raw["_target_"]))
    keys = {k: v for k, v in raw.items() if k not in ("_target_", "defaults")}
    assert set(keys) == set(settings), f"{path.name}: keys {sorted(set(keys) ^ set(settings))} differ from settings"
    for name, value in keys.items():
        if isinstance(value, str) and value.startswith("${"):
            continue  # filled in from the top-level config (seed, checkpoint.format): the key is there
        default = settings[name]
        assert value == (list(default) if isinstance(default, tuple) else default), f"{path.name}: {name}"


@pytest.mark.parametrize("path", sorted((CONF / "balancer").glob("*.yaml")), ids=lambda p: p.name)
def test_balancer_variants_only_choose_the_method(path: Path):
    raw = _load(path)
    if raw.get("_target_") or "defaults" not in raw:
        return  # the base file (above) or `off`
    assert raw["defaults"][0] == "optimal" and set(raw) == {"defaults", "method"}, path.name


def test_the_balancer_and_its_policy_share_one_settings_class():
    fields = {f.name: f.default for f in dataclasses.fields(BalancerSettings)}
    assert {f.name for f in dataclasses.fields(BalanceSettings)} <= set(fields)
    assert _settings(DynMoBalancer) == fields  # the callback's signature is the dataclass
    balancer = DynMoBalancer(warmup_steps=7, p2p_seconds=0.01, min_stages=2)
    policy = BalancePolicy("optimal")
    assert balancer.policy.settings == BalanceSettings(warmup_steps=7, p2p_seconds=0.01, min_stages=2)
    assert policy.settings.warmup_steps == BalanceSettings().warmup_steps == balancer.settings.__class__().warmup_steps


@pytest.mark.parametrize("path", [p for g in GROUPS for p in _files(g)], ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_component_has_one_settings_dataclass_with_a_docstring_per_field(path: Path):
    cls = _target(_load(path)["_target_"])
    settings = type(cls().settings)
    assert dataclasses.is_dataclass(settings) and all(f.kw_only for f in dataclasses.fields(settings))
    assert _settings(cls) == {f.name: f.default for f in dataclasses.fields(settings)}
    source = "".join(inspect.getsource(k) for k in settings.__mro__ if dataclasses.is_dataclass(k))
    for f in dataclasses.fields(settings):
        documented = re.search(rf"\n    {f.name}: [^\n]+\n    \"\"\"", source)
        assert documented, f"{settings.__name__}.{f.name} has no docstring"
    assert cls.from_settings(settings()).settings == settings()  # one object, or its fields as keywords
    params = inspect.signature(cls).parameters.values()
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params)  # LightningCLI requires positional ones
    with pytest.raises(TypeError, match=f"from_settings takes a {settings.__name__}, got int"):
        cls.from_settings(3)


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_renamed_settings_are_refused_naming_the_new_one(old: str):
    new = RENAMED[old]
    with pytest.raises(TypeError, match=rf"unknown setting '{old}'.*now '{new}'.*balancer\.{new}"):
        DynMoBalancer(**{old: 1})
    with pytest.raises(TypeError, match=r"did you mean 'every_n_steps' \(Hydra balancer.every_n_steps\)"):
        DynMoBalancer(every_n_step=3)


def _named_keys() -> set[tuple[str, str]]:
    """Every ``group.key=`` the package's messages name (string literals and f-string parts)."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found |= set(re.findall(r"\b(balancer|strategy|dynamics|checkpoint|profile|model)\.(\w+)=", node.value))
    return found


def _keys(group: str) -> set[str]:
    top = _load(CONF / "config.yaml")
    if isinstance(top.get(group), dict):
        return set(top[group])
    keys = set()
    for path in (CONF / group).glob("*.yaml"):
        raw = _load(path)
        keys |= set(raw)
        if raw.get("_target_"):
            keys |= set(_settings(_target(raw["_target_"])))  # a model's argument: `+model.<name>=` sets it
    return keys


def test_messages_name_only_keys_that_exist():
    missing = sorted(f"{g}.{k}" for g, k in _named_keys() if k not in _keys(g))
    assert not missing, f"messages name Hydra keys no config file has: {missing}"
    assert ("strategy", "heartbeat_timeout") in _named_keys()  # the scan sees the messages


def test_the_strategy_takes_its_settings_as_keywords_or_one_object():
    from dynmo_lightning import DynMoStrategy
    from dynmo_lightning.strategy.arguments import StrategySettings

    settings = StrategySettings(n_microbatches=8, schedule="zbv", stages_per_rank=2, partition=(2, 2, 1, 1))
    strategy = DynMoStrategy.from_settings(settings)
    assert (strategy.n_microbatches, strategy.schedule, strategy.partition) == (8, "zbv", [2, 2, 1, 1])
    # keywords over an object: checked together (zbv needs its two stages per rank from the object)
    assert DynMoStrategy.from_settings(settings, n_microbatches=4).settings == StrategySettings(
        n_microbatches=4, schedule="zbv", stages_per_rank=2, partition=[2, 2, 1, 1]
    )
    assert _settings(DynMoStrategy) == {f.name: f.default for f in dataclasses.fields(StrategySettings)}
    with pytest.raises(TypeError, match=r"did you mean 'n_microbatches' \(Hydra strategy.n_microbatches\)"):
        DynMoStrategy(n_microbatch=4)
    with pytest.raises(ValueError, match=r"strategy.heartbeat_timeout=0 must be > 0"):
        DynMoStrategy(heartbeat_timeout=0)
    with pytest.raises(TypeError, match="takes a StrategySettings"):
        DynMoStrategy.from_settings(BalancerSettings())
    with pytest.raises(TypeError, match="positional"):
        DynMoStrategy(settings)  # type: ignore[misc]
