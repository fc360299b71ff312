"""Parameters tied across pipeline layers (input embedding = output head), kept exact on any partition.

A tie is a parameter shared by several pipeline layers (the same ``nn.Parameter`` object, how Hugging Face models and
the reference GPT tie embeddings), or a group of parameters the model declares tied with
``pipeline_tied_parameters()`` (for models that tie by copying). Its first entry in layer order is canonical: it
names the tie in checkpoints' optimizer state and its layer's initialisation is the tie's value.

* Within one process every entry of a tie is the same tensor (re-tied after materialisation and after migrations):
  one parameter, one optimizer state, no communication.
* Across processes each owning process holds a copy. After the backward the copies' gradients are summed over the
  owners (one process group per set of owners), so every copy takes the same optimizer step and stays bit-identical,
  as the single tensor of the unsplit model would.
* When migration brings the owners together, the tie becomes local again (the arriving copy and its optimizer state
  are dropped); when they split, the departing layer takes a copy with its optimizer state along.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from dynmo_lightning.core.parts import local_part
from dynmo_lightning.optim import drop_params
from dynmo_lightning.pipeline.stage.runtime import StagePlan
from dynmo_lightning.pipeline.stage.slots import LayerSlots
from dynmo_lightning.pipeline.topology.world import StageWorld


class TieError(ValueError):
    """A tie the pipeline cannot keep (its copies differ in shape or dtype)."""


@dataclasses.dataclass(frozen=True)
class Tie:
    """One tied parameter: ``(layer index, path inside the layer)`` of every entry; ``names`` in the full model."""

    entries: tuple[tuple[int, str], ...]
    names: tuple[str, ...]

    @property
    def layers(self) -> set[int]:
        """Layers that use the tied parameter."""
        return {i for i, _ in self.entries}


def find_ties(module: nn.Module, layers: Sequence[nn.Module], layer_names: Sequence[str]) -> list[Tie]:
    """Ties among ``layers``: shared parameter objects, plus ``module.pipeline_tied_parameters()`` groups.

    Args:
        module: the LightningModule.
        layers: its pipeline layers.
        layer_names: each layer's qualified name in ``module`` (for checkpoint names).
    """
    by_param: dict[int, list[tuple[int, str]]] = {}
    for i, layer in enumerate(layers):
        for path, p in layer.named_parameters(remove_duplicate=False):
            by_param.setdefault(id(p), []).append((i, path))
    groups = [entries for entries in by_param.values() if len({i for i, _ in entries}) > 1]
    declared = getattr(module, "pipeline_tied_parameters", None)
    if callable(declared):
        prefix = {name: i for i, name in enumerate(layer_names)}
        for names in declared():
            entries = []
            for name in names:
                layer_name = max((n for n in prefix if name.startswith(n + ".")), key=len, default=None)
                if layer_name is None:
                    raise TieError(f"pipeline_tied_parameters() names {name!r}, which is in no pipeline layer")
                entries.append((prefix[layer_name], name[len(layer_name) + 1 :]))
            groups.append(entries)
    return [
        Tie(tuple(sorted(entries)), tuple(f"{layer_names[i]}.{path}" for i, path in sorted(entries)))
        for entries in groups
    ]


def _get(layer: nn.Module, path: str) -> nn.Parameter:
    return layer.get_parameter(path)


def _set(layer: nn.Module, path: str, param: nn.Parameter) -> None:
    owner_path, _, attr = path.rpartition(".")
    owner = layer.get_submodule(owner_path) if owner_path else layer
    setattr(owner, attr, param)


class TiedParameters:
    """Keeps the ties of a split model exact (see the module docstring).

    Args:
        ties: from :func:`find_ties`.
        world: the job's layout and this process's pipeline in it (the ``World``, changed in place by a resize).
        timeout: timeout of the ties' process groups.
    """

    def __init__(
        self,
        ties: list[Tie],
        world: StageWorld,
        timeout: timedelta | None = None,
    ) -> None:
        self.ties = ties
        self._world = world
        self._timeout = timeout
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self._alias = {name: tie.names[0] for tie in ties for name in tie.names[1:]}

    def __bool__(self) -> bool:
        return bool(self.ties)

    def canonical(self, name: str) -> str:
        """The tie's canonical parameter name for any of its names (other names pass through)."""
        return self._alias.get(name, name)

    def _global_rank(self, pp_rank: int) -> int:
        layout, mine = self._world.layout, self._world.row
        return layout.replicas[mine][pp_rank]

    def owners(self, tie: Tie, plan: StagePlan) -> tuple[int, ...]:
        """Pipeline ranks holding a copy of ``tie`` under ``plan``."""
        return tuple(sorted({plan.rank_of_layer(i) for i in tie.layers}))

    def prepare(self, plan: StagePlan, *, new_world: bool = False) -> None:
        """Create the process groups of the ties' owners under ``plan`` (collective: every process calls it).

        ``torch.distributed.new_group`` must be called by every process of the job, also those outside the group,
        so all groups are made here, at points every process reaches together, and cached. Every pipeline (each
        data-parallel replica's, per tensor-parallel rank) gets its own groups: its copies sum only its own
        gradients.
        """
        if new_world:
            self._groups.clear()
        layout, mine = self._world.layout, self._world.row
        for tie in self.ties:
            owners = self.owners(tie, plan)
            if len(owners) > 1 and owners not in self._groups:
                for row, ranks in enumerate(layout.replicas):
                    group = dist.new_group([ranks[r] for r in owners], timeout=self._timeout)
                    if row == mine:
                        self._groups[owners] = group

    def follow(
        self,
        slots: LayerSlots,
        plan: StagePlan,
        rank: int,
        optimizers: Sequence[Optimizer] = (),
        *,
        new_world: bool = False,
    ) -> None:
        """Adapt the ties to layers that moved under ``plan`` (collective): re-tie, make groups, check the copies."""
        self.retie(slots, optimizers)
        self.prepare(plan, new_world=new_world)
        self.check_shapes(slots, plan, rank, optimizers)

    def _cross(self, slots: LayerSlots, plan: StagePlan, rank: int) -> Iterator[tuple[Tie, nn.Parameter, Any]]:
        """This process's copy and the owners' group of every tie held by more than one process."""
        for tie in self.ties:
            owners = self.owners(tie, plan)
            if len(owners) < 2 or rank not in owners:
                continue
            i, path = next((i, p) for i, p in tie.entries if slots.is_local(i))
            yield tie, _get(slots.get(i), path), self._groups[owners]

    def retie(self, slots: LayerSlots, optimizers: Sequence[Optimizer]) -> None:
        """Make every local entry of a tie the same tensor (the first local one); drop the extra copies' state."""
        for tie in self.ties:
            local = [(i, path) for i, path in tie.entries if slots.is_local(i)]
            if len(local) < 2:
                continue
            keep = _get(slots.get(local[0][0]), local[0][1])
            extra = []
            for i, path in local[1:]:
                p = _get(slots.get(i), path)
                if p is not keep:
                    if p.shape != keep.shape:
                        raise TieError(
                            f"tied parameters {tie.names} have shapes {tuple(keep.shape)} and {tuple(p.shape)}: a "
                            "dynamic technique changed one copy (e.g. pruning); exclude tied parameters from it"
                        )
                    extra.append(p)
                    _set(slots.get(i), path, keep)
            drop_params(extra, optimizers)

    def check_shapes(self, slots: LayerSlots, plan: StagePlan, rank: int, optimizers: Sequence[Optimizer] = ()) -> None:
        """All copies of every cross-process tie have the same shape, dtype and optimizer settings (collective).

        Copies optimized with different hyperparameters (say, weight decay on the head but not on the embedding)
        would take different steps and silently stop being one parameter.
        """
        for tie, mine, group in self._cross(slots, plan, rank):
            copies: list[Any] = [None] * dist.get_world_size(group)
            layout = (tuple(mine.shape), str(mine.dtype))
            dist.all_gather_object(copies, (layout, _optimizer_settings(mine, optimizers)), group=group)
            found = {c[0] for c in copies}
            if len(found) > 1:
                raise TieError(
                    f"the copies of tied parameters {tie.names} differ across stages ({sorted(found)}); a tie "
                    "needs identical copies: keep dynamic techniques (e.g. pruning) away from tied parameters"
                )
            settings = [c[1] for c in copies]
            if len({repr(s) for s in settings}) > 1:
                raise TieError(
                    f"the copies of tied parameters {tie.names} are in optimizer parameter groups with different "
                    f"settings on different stages ({settings}); put every name of a tie in the same group "
                    "(e.g. the same weight-decay group) in configure_optimizers"
                )

    def sync_values(self, slots: LayerSlots, plan: StagePlan, rank: int) -> None:
        """Copy the canonical layer's value of every cross-process tie to all copies (after materialisation)."""
        for tie, mine, group in self._cross(slots, plan, rank):
            src = self._global_rank(plan.rank_of_layer(tie.entries[0][0]))
            with torch.no_grad():
                dist.broadcast(local_part(mine.detach()), src=src, group=group)

    def reduce_grads(self, slots: LayerSlots, plan: StagePlan, rank: int) -> None:
        """Sum the gradients of every cross-process tie's copies, so that every copy takes the same step."""
        for _, p, group in self._cross(slots, plan, rank):
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                # copies sharded alike (FSDP2: the same replica index, the same shard) sum their local parts
                dist.all_reduce(local_part(p.grad), op=dist.ReduceOp.SUM, group=group)

    def layers_of(self, name: str) -> set[int]:
        """Layers sharing the tied parameter ``name`` (empty if it is not tied)."""
        return next((tie.layers for tie in self.ties if name in tie.names), set())

    def counted_here(self, name: str, plan: StagePlan, rank: int) -> bool:
        """Whether this process counts tied parameter ``name`` in global sums (once per job: its lowest owner)."""
        for tie in self.ties:
            if name in tie.names:
                return rank == self.owners(tie, plan)[0]
        return True


def _optimizer_settings(param: nn.Parameter, optimizers: Sequence[Optimizer]) -> list[tuple[int, int, list]]:
    """``(optimizer, group, hyperparameters)`` of every optimizer group holding ``param``."""
    out = []
    for o, opt in enumerate(optimizers):
        for g, group in enumerate(opt.param_groups):
            if any(p is param for p in group["params"]):
                out.append((o, g, sorted((k, repr(v)) for k, v in group.items() if k != "params")))
    return out
