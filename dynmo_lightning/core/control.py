"""The strategy contracts callbacks rely on: the roles of :class:`PipelineControl`, and :class:`PreLaunchCheck`.

``DynMoStrategy`` gives every role as ``strategy.pipeline_control``: :class:`RunFacts` (the summaries),
:class:`LayerEvents` (the dynamics), :class:`Rebalancing` (the balancer), and :class:`LayerEditing` (structured
pruning). Callbacks ask for theirs with :func:`pipeline_control` and :func:`layer_editing` and never import the
strategy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar, runtime_checkable

from torch import Tensor

Role = TypeVar("Role")


@dataclasses.dataclass(frozen=True)
class JobShape:
    """What the launching process knows of a pipeline job before any worker starts (for :class:`PreLaunchCheck`).

    Attributes:
        world_size: processes of the job.
        pp_size: processes of one pipeline.
        stages_per_rank: pipeline stages per process.
        layer_param_bytes: bytes of every pipeline layer's parameters (``None``: unknown without building the model).
        data_parallel: how replicas share a stage's layers (``"ddp"``, ``"replicate"`` or ``"fsdp"``).
        tensor_parallel_size: processes every stage is split over.
        tied_ends: the first and the last pipeline layer share a parameter (tied embeddings; ``False``: they do
            not, or it is unknown without building the model).
    """

    world_size: int
    pp_size: int
    stages_per_rank: int
    layer_param_bytes: list[int] | None
    data_parallel: str = "ddp"
    tensor_parallel_size: int = 1
    tied_ends: bool = False

    @property
    def n_stages(self) -> int:
        """Pipeline stages."""
        return self.pp_size * self.stages_per_rank

    @property
    def data_parallel_size(self) -> int:
        """Replicas of the pipeline (``D``)."""
        return self.world_size // (self.pp_size * self.tensor_parallel_size)

    @property
    def held_fraction(self) -> float:
        """The part of each of its layers a process holds: ``1 / replicas`` under ``"fsdp"``, else all of it.

        Tensor parallelism is not counted: which layers a plan splits is known only once they are built.
        """
        return 1.0 / self.data_parallel_size if self.data_parallel == "fsdp" else 1.0


@runtime_checkable
class PreLaunchCheck(Protocol):
    """A callback whose settings can contradict the job's size: refused by the launching process, once, in one line."""

    def pipeline_check_job(self, job: JobShape) -> None:
        """Raise ``ValueError`` (naming the setting and the fix) if this callback cannot work in ``job``."""


@runtime_checkable
class RunFacts(Protocol):
    """The role of a callback that reports on the run (the run summary, the model summary, the cost trace).

    What the pipeline is and was: its shape, the partition in force and every change, the releases, and the whole
    model's norms (collective). Every property answers (with an empty value) before the strategy is set up.
    """

    n_microbatches: int
    schedule: str
    stages_per_rank: int
    #: How replicas share a stage's layers: ``"ddp"`` (whole), ``"replicate"`` (whole, DTensors), ``"fsdp"`` (shards).
    data_parallel: str
    #: Processes every stage is split over (tensor parallelism; 1: none).
    tensor_parallel_size: int

    @property
    def world_size(self) -> int:
        """Processes of the job."""
        ...

    @property
    def n_layers(self) -> int:
        """Pipeline layers of the model."""
        ...

    @property
    def n_stages(self) -> int:
        """(Virtual) pipeline stages."""
        ...

    @property
    def pp_size(self) -> int:
        """Processes of one pipeline."""
        ...

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas of the pipeline."""
        ...

    @property
    def layers_per_stage(self) -> list[int]:
        """The split in force."""
        ...

    @property
    def layer_param_counts(self) -> list[int]:
        """Parameters of every pipeline layer."""
        ...

    @property
    def partitions(self) -> list[dict[str, Any]]:
        """``[{"step", "layers_per_stage"}]``: the initial split and every change."""
        ...

    @property
    def releases(self) -> list[dict[str, Any]]:
        """Every release by a consolidation (ranks, hosts, whole nodes freed)."""
        ...

    @property
    def replica_ranks(self) -> list[list[int]]:
        """Global ranks of every replica's pipeline, by pipeline rank."""
        ...

    @property
    def host_group(self) -> Any:
        """A CPU (gloo) group of the whole job for host data (``None``: the default group, a CPU group then)."""
        ...

    def changed_layers(self, step: int) -> list[int]:
        """The layers reported changed while ``step`` optimizer steps were done (the balancer reacts to them)."""
        ...

    def tie_layers(self, param: Tensor) -> set[int]:
        """Pipeline layers sharing ``param`` in the unsplit model."""
        ...

    def param_norm(self) -> float:
        """L2 norm of all the model's parameters, across stages (collective)."""
        ...

    def replicas_in_sync(self) -> bool:
        """Whether every replica holds the same parameters and buffers (collective)."""
        ...


@runtime_checkable
class LayerEvents(Protocol):
    """The role of a dynamics callback (freezing, pruning, early exit, MoD, MoE, sparse attention).

    It tells the pipeline which layers changed, asks which layers share a parameter, sums values over the processes
    holding other parts of its layers, and gathers decisions over the job's CPU group, replica by replica.
    """

    @property
    def n_layers(self) -> int:
        """Pipeline layers of the model."""
        ...

    @property
    def replica_ranks(self) -> list[list[int]]:
        """Global ranks of every replica's pipeline, by pipeline rank."""
        ...

    @property
    def host_group(self) -> Any:
        """A CPU (gloo) group of the whole job for host data (``None``: the default group, a CPU group then)."""
        ...

    def on_layers_changed(self, layers: list[int] | None = None) -> None:
        """Layers changed (their cost, or which parameters train): rebuild before the next step."""
        ...

    def tie_layers(self, param: Tensor) -> set[int]:
        """Pipeline layers sharing ``param`` in the unsplit model."""
        ...

    def shard_sum(self, values: Tensor) -> Tensor:
        """``values`` summed over the processes holding the other parts of the same layers (collective over them).

        ``values`` are per local layer, computed from this process's part of each; where every process holds its
        layers whole, ``values`` itself.
        """
        ...


@runtime_checkable
class Rebalancing(RunFacts, Protocol):
    """The role of the balancer: measure the layers, move them, consolidate onto fewer processes, grow back.

    Also what it needs of :class:`RunFacts` (the shape it plans for, the partition in force).
    """

    #: How FSDP2 units hold a step's weights and gradients, as set: ``"fast"``, ``"lean"`` or ``"auto"``.
    fsdp_memory: str

    @property
    def waiting(self) -> int:
        """Released processes waiting to be re-admitted by :meth:`grow`."""
        ...

    @property
    def pipeline_nodes(self) -> list[Any] | None:
        """The node each pipeline rank runs on (``None``: unknown); a repack frees whole nodes."""
        ...

    def request_profile(self) -> None:
        """Profile the coming training step (several callbacks may ask)."""
        ...

    def profile_results(self) -> dict[int, dict[str, float]] | None:
        """Every layer's measured costs of the step just profiled (collective), or ``None``."""
        ...

    def repartition(self, layers_per_stage: list[int]) -> Any:
        """Move layers to a new split (collective); returns what moved."""
        ...

    @property
    def fsdp_memory_in_force(self) -> str:
        """How FSDP2 units hold a step's weights and gradients now: ``"fast"`` or ``"lean"``."""
        ...

    def set_fsdp_memory(self, way: str) -> None:
        """Hold FSDP2 units' weights and gradients ``way`` (``"fast"``, ``"lean"``) from the next step on.

        Every process of the job must switch alike (the balancer decides for all of them).
        """
        ...

    def shrink(
        self, keep_ranks: list[int], layers_per_stage: list[int], *, on_release: str = "exit", release_to: Any = None
    ) -> Any:
        """Consolidate onto ``keep_ranks`` and release the other processes; tell ``release_to`` (collective)."""
        ...

    def grow(self, layers_per_stage: list[int]) -> Any:
        """Re-admit waiting processes as new stages of ``layers_per_stage`` (collective)."""
        ...

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Global rank ``src``'s ``obj`` on every process (collective)."""
        ...

    def run_neighbours(self, stage_of: Any) -> Any:
        """Run a neighbour protocol over the pipeline (collective over it, point-to-point only).

        ``stage_of(pipeline_rank)`` builds this process's stage machine
        (:class:`~dynmo_lightning.balance.diffusion.driver.DiffusionStage`); returns the run's
        :class:`~dynmo_lightning.pipeline.stage.neighbours.NeighbourStats`.
        """
        ...


@runtime_checkable
class PipelineControl(Rebalancing, LayerEvents, Protocol):
    """Everything a callback may ask a pipeline strategy and tell it: every role at once (``DynMoStrategy`` gives it).

    Callbacks reach the strategy through these contracts only (:func:`pipeline_control`), never through the class,
    each asking for the role it needs (:class:`RunFacts`, :class:`LayerEvents`, :class:`Rebalancing`), so the
    dynamics callbacks run unchanged under strategies that do not split the model, and tests can drive the balancer
    with a stand-in of its role only.
    """


@runtime_checkable
class LayerEditing(Protocol):
    """The role of a callback that changes a layer's shapes (structured pruning): read it whole, change it whole.

    A layer held in parts (FSDP2 shards, tensor-parallel parts) is gathered for either (collective over the processes
    holding its parts: all of them call with the same layers in the same order) and made parts again after a change.
    """

    @property
    def unit_multiple(self) -> int:
        """What a prunable unit count must stay a multiple of (the tensor-parallel size: each process holds 1/T)."""
        ...

    def whole_layer(self, index: int) -> AbstractContextManager[Any]:
        """Within: local layer ``index`` whole, to read (a copy if held in parts)."""
        ...

    def reshape_layer(self, index: int, change: Callable[[Any, Sequence[Any]], None]) -> None:
        """Apply ``change(layer, optimizers)`` to local layer ``index`` whole, its optimizer state with it."""
        ...


def layer_editing(trainer: Any) -> LayerEditing | None:
    """The trainer's strategy's :class:`LayerEditing` role, or ``None`` (layers are then changed where they are)."""
    role = getattr(pipeline_control(trainer, LayerEvents), "layer_editing", None)
    editing = role() if callable(role) else None
    return editing if isinstance(editing, LayerEditing) else None


def pipeline_control(trainer: Any, role: type[Role] = PipelineControl) -> Role | None:  # type: ignore[assignment]
    """The trainer's strategy in ``role`` (:class:`PipelineControl`: every role), or ``None`` if it has none.

    A pipeline strategy gives its roles as ``strategy.pipeline_control``; a stand-in may be one itself.
    """
    strategy = getattr(trainer, "strategy", None)
    control = getattr(strategy, "pipeline_control", strategy)
    return control if isinstance(control, role) else None
