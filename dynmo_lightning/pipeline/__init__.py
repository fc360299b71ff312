"""The pipeline runtime in five parts, each importing only those listed before it; ``DynMoStrategy`` drives them.

* ``topology`` - who is who and how they talk: the rank mapping, process groups and meshes, the ``World``, data
  shards, transport, heartbeats.
* ``parallel`` - parallelism inside one stage: tensor parallelism, data parallelism (DDP, FSDP2, replicate), DTensor
  values, compiled layers.
* ``stage`` - the stages one process runs: cutting the model, ties, the runtime and its schedules, migration,
  reshaping, reductions, evaluation, neighbours.
* ``elastic`` - worlds that change while training runs: survivors, members, releases, resizes, lifetimes.
* ``checkpoint`` - checkpoints of a split model: one file, sharded, read without running code.

``elastic`` and ``checkpoint`` import neither each other nor anything above them; the strategy's own package
(:mod:`dynmo_lightning.strategy`) sits on top. Modules of the flat ``pipeline/`` before it had parts keep their old
import paths (``dynmo_lightning.pipeline.sharded``, ``.release``, ...) with a ``DeprecationWarning``; the old
``checkpoint`` and ``elastic`` modules are the packages of those names now (``checkpoint.single_file``,
``elastic.members``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

from dynmo_lightning.pipeline.stage.runtime import PipelineRuntime, StagePlan
from dynmo_lightning.pipeline.stage.schedules import SCHEDULES
from dynmo_lightning.pipeline.stage.slots import LayerSlots, RemoteLayer, StageModule

__all__ = ["SCHEDULES", "LayerSlots", "PipelineRuntime", "RemoteLayer", "StageModule", "StagePlan"]

#: Old module -> where it lives now (several: a module split in parts, searched in order).
MOVED: dict[str, tuple[str, ...]] = {
    "layout": ("topology.ranks", "topology.mesh", "topology.data"),
    "transport": ("topology.transport",),
    "watchdog": ("topology.heartbeats",),
    "tensor_parallel": ("parallel.tensor_parallel",),
    "compiled": ("parallel.compiled",),
    "sharding": ("parallel.data_parallel", "parallel.dtensors"),
    "split": ("stage.cut",),
    "layers": ("stage.slots",),
    "ties": ("stage.ties",),
    "runtime": ("stage.runtime", "stage.schedules", "stage.torch_stage"),
    "stages": ("stage.local",),
    "migration": ("stage.migration",),
    "reshape": ("stage.reshape",),
    "reduce": ("stage.reduce",),
    "evaluation": ("stage.evaluation",),
    "neighbours": ("stage.neighbours",),
    "groups": ("elastic.survivors",),
    "release": ("elastic.release",),
    "resize": ("elastic.resize",),
    "worlds": ("elastic.lifetimes",),
    "sharded": ("checkpoint.sharded",),
    "safe_load": ("checkpoint.safe_load",),
    "launcher": ("dynmo_lightning.strategy.checks", "dynmo_lightning.strategy.launcher"),
    "plugins": ("dynmo_lightning.strategy.plugins",),
    "precision": ("dynmo_lightning.strategy.precision",),
    "strategy_settings": ("dynmo_lightning.strategy.arguments",),
}


def _new_name(part: str) -> str:
    return part if part.startswith("dynmo_lightning.") else f"{__name__}.{part}"


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``dynmo_lightning.pipeline.<old>`` as the module(s) it moved to, with a ``DeprecationWarning``.

    A module that moved whole is that module (patching one patches the other); one split in parts is a module
    that finds each name in its parts.
    """

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec:
        old = fullname.rpartition(".")[2]
        if fullname.rpartition(".")[0] != __name__ or old not in MOVED:
            return None  # type: ignore[return-value]  # not ours: the next finder looks
        return importlib.machinery.ModuleSpec(fullname, self)

    def __init__(self) -> None:
        self._specs: dict[int, importlib.machinery.ModuleSpec | None] = {}

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        old = spec.name.rpartition(".")[2]
        parts = [_new_name(p) for p in MOVED[old]]
        warnings.warn(f"{spec.name} moved to {' and '.join(parts)}", DeprecationWarning, stacklevel=3)
        modules = [importlib.import_module(p) for p in parts]
        if len(modules) == 1:
            self._specs[id(modules[0])] = modules[0].__spec__  # the import system sets the alias's: put it back
            return modules[0]
        joined = types.ModuleType(spec.name, f"Moved: the names of {', '.join(parts)}.")
        joined.__getattr__ = lambda name: _first(modules, name)  # type: ignore[method-assign]
        return joined

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run (the module was imported already); a moved module keeps its own spec."""
        if id(module) in self._specs:
            module.__spec__ = self._specs.pop(id(module))


def _first(modules: list[types.ModuleType], name: str) -> object:
    for module in modules:
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(name)


if not any(isinstance(finder, _Moved) for finder in sys.meta_path):
    sys.meta_path.append(_Moved())
