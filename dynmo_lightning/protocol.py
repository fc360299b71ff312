"""The pipeline model protocol: what a LightningModule provides so that DynMo can split it into stages.

A module is *pipeline-ready* when it has

- ``pipeline_layers() -> Sequence[nn.Module]``: the ordered layers; layer ``i`` maps the output of layer ``i - 1``
  (a tensor or a tuple of tensors) to its own output. The first layer receives the batch inputs.
- ``pipeline_loss(output, target) -> Tensor``: the scalar loss of one micro-batch from the last layer's output.

and optionally

- ``pipeline_split_batch(batch) -> (inputs, target)``: how a dataloader batch splits into the first layer's inputs
  and the loss target (default: ``batch`` is the pair ``(inputs, target)``).
- ``pipeline_eval_step(output, target, stage)``: compute and ``self.log`` evaluation metrics of a batch from the last
  layer's output (``stage``: ``"val"`` or ``"test"``). Under the strategy the module's ``validation_step`` and
  ``test_step`` are not called (it runs the pipeline and logs ``{stage}_loss`` itself); this hook runs on the last
  stage and its logs are replayed on every process (``pipeline/evaluation.py``).
- ``pipeline_unused_parameters()`` on any submodule: ``True`` if a step may leave some of its trainable parameters
  without a gradient (data-parallel replicas then let DDP look for them).
- ``pipeline_init_layer(index, layer)``: (re-)initialise the parameters of layer ``index`` in place. Used when layers
  are created on the meta device (Lightning's ``configure_model``) and materialised on their own stage only. Without
  it, every submodule's ``reset_parameters()`` is called.

:class:`PipelineModule` is a LightningModule base class that turns the protocol into single-process ``forward``,
``training_step``, ``validation_step`` and ``test_step``, so one model class trains both with and without
``DynMoStrategy`` (under the strategy, the strategy runs the steps through the pipeline and logs the same names).

The second contract here is :class:`PipelineControl`: what callbacks (the balancer, the dynamics, the run summary)
may ask a pipeline strategy and tell it. ``DynMoStrategy`` implements it; callbacks find it with
:func:`pipeline_control` and never import the strategy.

This module is the lowest layer of the package: models, callbacks, the pipeline runtime and the strategy import it,
it imports none of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import lightning.pytorch as L
import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

#: Seeds of different layers are spread this far apart so that nearby base seeds never collide.
_SEED_STRIDE = 1_000_003


class ProtocolError(TypeError):
    """The LightningModule does not implement the pipeline model protocol."""


def check_protocol(module: Any) -> list[nn.Module]:
    """Validate that ``module`` implements the pipeline protocol and return its layers.

    Args:
        module: the LightningModule given to the Trainer.

    Returns:
        The ordered list of pipeline layers.

    Raises:
        ProtocolError: a method is missing or ``pipeline_layers()`` returns something unusable.

    """
    name = type(module).__name__
    missing = [m for m in ("pipeline_layers", "pipeline_loss") if not callable(getattr(module, m, None))]
    if missing:
        raise ProtocolError(
            f"{name} cannot be split into pipeline stages: it has no {' and no '.join(f'`{m}()`' for m in missing)}. "
            "A pipeline-ready LightningModule defines `pipeline_layers()` (the ordered nn.Modules, each mapping the "
            "previous layer's output to its own) and `pipeline_loss(output, target)` (the loss of one micro-batch). "
            "See the README section 'Model protocol'."
        )
    layers = module.pipeline_layers()
    if isinstance(layers, nn.Module) and not isinstance(layers, (nn.ModuleList, nn.Sequential)):
        raise ProtocolError(f"{name}.pipeline_layers() must return a sequence of nn.Modules, got one {type(layers)}.")
    layers = list(layers)
    if not layers:
        raise ProtocolError(f"{name}.pipeline_layers() returned no layers.")
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise ProtocolError(f"{name}.pipeline_layers()[{i}] is a {type(layer).__name__}, not an nn.Module.")
    seen: dict[int, int] = {}
    for i, layer in enumerate(layers):
        if id(layer) in seen:
            raise ProtocolError(
                f"{name}.pipeline_layers() lists the same module at positions {seen[id(layer)]} and {i}; "
                "every layer must be a distinct module."
            )
        seen[id(layer)] = i
    return layers


def split_batch(module: Any, batch: Any) -> tuple[Any, Any]:
    """Split a dataloader batch into (inputs, target) with the module's hook or the default pair convention."""
    hook = getattr(module, "pipeline_split_batch", None)
    if callable(hook):
        return hook(batch)
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ProtocolError(
        f"{type(module).__name__}: a batch must be a pair (inputs, target), got {type(batch).__name__}"
        f"{f' of length {len(batch)}' if isinstance(batch, (tuple, list)) else ''}. "
        "Define `pipeline_split_batch(batch) -> (inputs, target)` on the module to say how to split it."
    )


def layer_seed(base_seed: int, index: int) -> int:
    """The seed that initialises layer ``index``: the same wherever (on whichever stage) the layer is built."""
    return (base_seed * _SEED_STRIDE + index) % (2**63 - 1)


def init_layer(module: Any, index: int, layer: nn.Module, base_seed: int) -> None:
    """Initialise layer ``index`` deterministically from ``base_seed`` and its index, on the CPU.

    Uses ``module.pipeline_init_layer(index, layer)`` when the module defines it, else every submodule's
    ``reset_parameters()``, with the CPU generator seeded from :func:`layer_seed`: a layer on an accelerator is
    initialised on the host and copied back (in place: the parameters stay the same objects), because devices' own
    generators differ (CUDA's from the CPU's, and between GPU models), and layer ``i`` must get the same weights on
    any stage and device. The global RNG state is left untouched.

    Raises:
        ProtocolError: a submodule owns parameters but the layer cannot be re-initialised.

    """
    device = next((t.device for t in layer.parameters()), torch.device("cpu"))
    if device.type not in ("cpu", "meta"):
        layer.to("cpu")
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(layer_seed(base_seed, index))
            _reset(module, index, layer)
    finally:
        if device.type not in ("cpu", "meta"):
            layer.to(device)


def materialise_layer(module: Any, index: int, layer: nn.Module, base_seed: int, device: torch.device) -> None:
    """Give meta-device layer ``index`` storage on ``device``, initialised on the host (:func:`init_layer`)."""
    layer.to_empty(device="cpu")
    init_layer(module, index, layer, base_seed)
    if torch.device(device).type != "cpu":
        layer.to(device)


def _reset(module: Any, index: int, layer: nn.Module) -> None:
    hook = getattr(module, "pipeline_init_layer", None)
    if callable(hook):
        hook(index, layer)
        return
    for sub in layer.modules():
        owns_params = any(True for _ in sub.parameters(recurse=False))
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()
        elif owns_params:
            raise ProtocolError(
                f"Layer {index} ({type(layer).__name__}) was created on the meta device but its submodule "
                f"{type(sub).__name__} has parameters and no `reset_parameters()`. Define "
                f"`pipeline_init_layer(index, layer)` on {type(module).__name__} to initialise a layer in place."
            )


_probing = False


@contextlib.contextmanager
def probing() -> Iterator[None]:
    """Mark a forward pass that must not count: layers must not update statistics.

    Shape probes (they only discover activation shapes) and the recomputation of checkpointed layers in backward
    (it repeats a forward already counted; :mod:`dynmo_lightning.recompute`) run under it.
    """
    global _probing
    previous, _probing = _probing, True
    try:
        yield
    finally:
        _probing = previous


def is_probing() -> bool:
    """True inside :func:`probing`; dynamic layers skip their bookkeeping then."""
    return _probing


_on_host = False


@contextlib.contextmanager
def on_host() -> Iterator[None]:
    """Mark work on host data only: CPU tensors of a CPU (gloo) process group, pickled control messages.

    None of it reads or waits for the accelerator (under NCCL these groups never touch the device), so
    ``HostSyncCounter`` counts what runs inside apart (``[host]``); on a CPU-only run it could not tell otherwise.
    Only wrap code whose tensors are all made and kept on the host.
    """
    global _on_host
    previous, _on_host = _on_host, True
    try:
        yield
    finally:
        _on_host = previous


def is_on_host() -> bool:
    """True inside :func:`on_host`."""
    return _on_host


_stage_memo: dict[str, Any] | None = None


@contextlib.contextmanager
def stage_forward() -> Iterator[dict[str, Any]]:
    """Mark one forward of a stage's layers on one micro-batch; layers share host-side values in its memo.

    A value read from the device once per stage forward (e.g. an upper bound on the active tokens, which exits only
    lower) serves every later layer of the stage, so the forward pays one host synchronisation, not one per layer.
    """
    global _stage_memo
    previous, _stage_memo = _stage_memo, {}
    try:
        yield _stage_memo
    finally:
        _stage_memo = previous


def stage_memo() -> dict[str, Any] | None:
    """The memo of the :func:`stage_forward` in progress (``None`` outside one)."""
    return _stage_memo


def host_value(module: nn.Module, name: str) -> float:
    """The value of the scalar buffer ``module.<name>`` as a Python float, read from the device only when it changed.

    Thresholds, capacities and densities live in buffers so that they checkpoint and migrate with their layer, but
    reading a GPU buffer each forward stalls the stream. The value is cached with the buffer object and its version
    counter (bumped by every in-place write, ``load_state_dict`` included), so a forward reads the device only after
    something else wrote the buffer; :func:`set_host_value` writes without a read.
    """
    if has_host_value(module, name):
        return module.__dict__["_host_values"][name][2]
    buffer = getattr(module, name)
    value = float(buffer)  # the one read after an outside write
    module.__dict__.setdefault("_host_values", {})[name] = (buffer, buffer._version, value)
    return value


def has_host_value(module: nn.Module, name: str) -> bool:
    """Whether the host knows the current value of the scalar buffer ``module.<name>`` (no read would follow)."""
    buffer = getattr(module, name)
    cached = module.__dict__.get("_host_values", {}).get(name)
    return cached is not None and cached[0] is buffer and cached[1] == buffer._version


def set_host_value(module: nn.Module, name: str, value: float) -> None:
    """Write ``value`` into the scalar buffer ``module.<name>`` and remember it (no device read follows)."""
    buffer = getattr(module, name)
    with torch.no_grad():
        buffer.fill_(value)
    module.__dict__.setdefault("_host_values", {})[name] = (buffer, buffer._version, float(value))


def may_leave_parameters_unused(module: nn.Module) -> bool:
    """Whether a step may leave some trainable parameters of ``module`` without a gradient.

    A submodule says so with ``pipeline_unused_parameters() -> bool`` (an MoE layer running expert by expert); data
    parallelism then lets DDP find them each step, which costs a graph search and a read of the device.
    """
    return any(callable(hook := getattr(m, "pipeline_unused_parameters", None)) and hook() for m in module.modules())


def local_part(t: Tensor) -> Tensor:
    """The part of ``t`` this process holds: a DTensor's local shard (FSDP2 sharding), any other tensor itself.

    Element-wise work on a layer's weights (pruning masks, norms summed per process) runs on this part, with no
    collective.
    """
    return t.to_local() if isinstance(t, DTensor) else t


def read_once(values: Sequence[Tensor | float]) -> list[float]:
    """Python numbers of ``values`` (scalar tensors or numbers) with one device read for all the tensors."""
    tensors = [v for v in values if isinstance(v, Tensor)]
    read = iter(torch.stack([t.detach().float().reshape(()) for t in tensors]).tolist() if tensors else [])
    return [next(read) if isinstance(v, Tensor) else float(v) for v in values]


class DeviceScalars:
    """Numbers recorded every step (losses) kept on the device until asked for, then read together.

    ``float(loss)`` in a step's hook waits for the device to finish the step; appending the tensor does not. The
    values come to the host in one read when :attr:`values` is asked for, or every ``flush_every`` appends (so the
    pending tensors stay few).

    Args:
        flush_every: most values kept on the device.
    """

    def __init__(self, flush_every: int = 256) -> None:
        self._read: list[float] = []
        self._pending: list[Tensor | float] = []
        self.flush_every = flush_every

    def append(self, value: Tensor | float) -> None:
        """Record ``value`` (a scalar tensor, detached here, or a number)."""
        self._pending.append(value.detach() if isinstance(value, Tensor) else float(value))
        if len(self._pending) >= self.flush_every:
            self._flush()

    @property
    def values(self) -> list[float]:
        """Every value recorded, as Python floats (reads the pending ones in one go)."""
        self._flush()
        return self._read

    def _flush(self) -> None:
        if self._pending:
            tensors = [v for v in self._pending if isinstance(v, Tensor)]
            read = iter(torch.stack([t.double().reshape(()) for t in tensors]).tolist() if tensors else [])
            self._read.extend(next(read) if isinstance(v, Tensor) else v for v in self._pending)
            self._pending = []


def local_layers(module: Any) -> list[tuple[int, nn.Module]]:
    """``(index, layer)`` of the pipeline layers held by this process (all of them without a pipeline strategy).

    Layers of other pipeline stages are placeholders marked ``pipeline_remote``; dynamics callbacks change only the
    layers they hold, and agree with the other processes through collectives.
    """
    return [
        (i, layer) for i, layer in enumerate(module.pipeline_layers()) if not getattr(layer, "pipeline_remote", False)
    ]


def layers_changed(trainer: Any, layers: Iterable[int] | None = None) -> None:
    """Tell the strategy that layers changed their cost or which parameters train (call on every process).

    A pipeline strategy rebuilds its stages before the next step (stage boundaries may stop carrying gradients) and
    tells the balancer, which restarts the changed layers' cost history; other strategies ignore it.

    Args:
        trainer: the Trainer.
        layers: indices of the layers that changed (``None``: any may have).
    """
    control = pipeline_control(trainer)
    if control is not None:
        control.on_layers_changed(None if layers is None else sorted(set(layers)))


def all_gather(obj: Any, trainer: Any = None, *, replicas: bool = False) -> list[Any]:
    """Every process's ``obj`` (just ``[obj]`` without torch.distributed): how dynamics agree on global decisions.

    Under data parallelism, the pipeline's processes of the first replica only, by pipeline rank: replicas hold the
    same layers, so a decision made from one replica's parts is the same on every process of the job (and the same
    as without replicas, where what is gathered is the same everywhere).

    Args:
        obj: this process's part (picklable).
        trainer: the Trainer (a pipeline strategy says how processes form replicas); ``None``: every process's part.
        replicas: return ``[[parts of replica 0], [parts of replica 1], ...]`` instead (for statistics of data that
            differ between replicas).
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [[obj]] if replicas else [obj]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    control = pipeline_control(trainer) if trainer is not None else None
    if control is not None:  # over the strategy's CPU group: pickles never staged on a GPU
        with on_host():
            torch.distributed.all_gather_object(out, obj, group=control.host_group)
    else:
        torch.distributed.all_gather_object(out, obj)
    layout = (control.replica_ranks if control is not None else None) or [list(range(len(out)))]
    by_replica = [[out[r] for r in ranks] for ranks in layout]
    return by_replica if replicas else by_replica[0]


@dataclasses.dataclass(frozen=True)
class JobShape:
    """What the launching process knows of a pipeline job before any worker starts (for :class:`PreLaunchCheck`).

    Attributes:
        world_size: processes of the job.
        pp_size: processes of one pipeline.
        stages_per_rank: pipeline stages per process.
        layer_param_bytes: bytes of every pipeline layer's parameters (``None``: unknown without building the model).
        data_parallel: how replicas share a stage's layers (``"ddp"``, ``"replicate"`` or ``"fsdp"``).
    """

    world_size: int
    pp_size: int
    stages_per_rank: int
    layer_param_bytes: list[int] | None
    data_parallel: str = "ddp"

    @property
    def n_stages(self) -> int:
        """Pipeline stages."""
        return self.pp_size * self.stages_per_rank

    @property
    def held_fraction(self) -> float:
        """The part of each of its layers a process holds: ``1 / replicas`` under ``"fsdp"``, else all of it."""
        return self.pp_size / self.world_size if self.data_parallel == "fsdp" else 1.0


@runtime_checkable
class PreLaunchCheck(Protocol):
    """A callback whose settings can contradict the job's size: refused by the launching process, once, in one line."""

    def pipeline_check_job(self, job: JobShape) -> None:
        """Raise ``ValueError`` (naming the setting and the fix) if this callback cannot work in ``job``."""


@runtime_checkable
class PipelineControl(Protocol):
    """What a callback may ask a pipeline strategy and tell it (``DynMoStrategy`` implements it).

    Callbacks reach the strategy through this contract only (:func:`pipeline_control`), never through the class, so
    the dynamics callbacks run unchanged under strategies that do not split the model, and tests can drive the
    balancer with a stand-in. Every property answers (with an empty value) before the strategy is set up.
    """

    n_microbatches: int
    schedule: str
    stages_per_rank: int
    #: How replicas share a stage's layers: ``"ddp"`` (whole), ``"replicate"`` (whole, DTensors), ``"fsdp"`` (shards).
    data_parallel: str

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
    def waiting(self) -> int:
        """Released processes waiting to be re-admitted by :meth:`grow`."""
        ...

    @property
    def releases(self) -> list[dict[str, Any]]:
        """Every release by a consolidation (ranks, hosts, whole nodes freed)."""
        ...

    @property
    def partitions(self) -> list[dict[str, Any]]:
        """``[{"step", "layers_per_stage"}]``: the initial split and every change."""
        ...

    @property
    def replica_ranks(self) -> list[list[int]]:
        """Global ranks of every replica's pipeline, by pipeline rank."""
        ...

    @property
    def host_group(self) -> Any:
        """A CPU (gloo) group of the whole job for host data (``None``: the default group, a CPU group then)."""
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

    def on_layers_changed(self, layers: list[int] | None = None) -> None:
        """Layers changed (their cost, or which parameters train): rebuild before the next step."""
        ...

    def changed_layers(self, step: int) -> list[int]:
        """The layers reported changed while ``step`` optimizer steps were done (the balancer reacts to them)."""
        ...

    def repartition(self, layers_per_stage: list[int]) -> Any:
        """Move layers to a new split (collective); returns what moved."""
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
        (:class:`~dynmo_lightning.balance.diffusion.DiffusionStage`); returns the run's
        :class:`~dynmo_lightning.pipeline.neighbours.NeighbourStats`.
        """
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

    def shard_sum(self, values: Tensor) -> Tensor:
        """``values`` summed over the processes holding the other parts of the same layers (collective over them).

        ``values`` are per local layer, computed from this process's part of each; where every process holds its
        layers whole, ``values`` itself.
        """
        ...


def pipeline_control(trainer: Any) -> PipelineControl | None:
    """The trainer's strategy as a :class:`PipelineControl`, or ``None`` when it does not split the model."""
    strategy = getattr(trainer, "strategy", None)
    return strategy if isinstance(strategy, PipelineControl) else None


def as_tuple(x: Any) -> tuple[Any, ...]:
    """Normalise a layer's input/output to a tuple (layers may pass a tensor or a tuple of tensors)."""
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def call_layer(layer: nn.Module, x: Any) -> Any:
    """Apply one layer; a tuple input is unpacked into positional arguments.

    A frozen layer (``layer.pipeline_frozen``) whose inputs carry no gradient runs without autograd: nothing before
    it trains, so nothing needs its backward - even when it uses a parameter tied to a layer that keeps training (a
    token embedding tied to the head learns through the head alone once the embedding is frozen).
    """
    call = (lambda: layer(*x)) if isinstance(x, tuple) else (lambda: layer(x))
    if runs_without_autograd(layer, x):
        with torch.no_grad():
            return call()
    return call()


def run_layers(layers: Sequence[nn.Module], x: Any) -> Any:
    """Apply ``layers`` in order (:func:`call_layer`); a tuple output becomes the next layer's arguments."""
    for layer in layers:
        x = call_layer(layer, x)
    return x


def runs_without_autograd(layer: nn.Module, x: Any) -> bool:
    """Whether :func:`call_layer` runs ``layer`` on ``x`` without autograd: it is frozen and ``x`` has no gradient."""
    return getattr(layer, "pipeline_frozen", False) and not any(
        isinstance(t, Tensor) and t.requires_grad for t in as_tuple(x)
    )


class PipelineModule(L.LightningModule):
    """LightningModule base for pipeline-ready models: implement ``pipeline_layers`` and ``pipeline_loss``.

    Provides ``forward`` (all layers in order) and single-process ``training_step`` / ``validation_step`` /
    ``test_step`` that log ``train_loss``, ``val_loss`` and ``val_ppl`` (``test_*``), the names ``DynMoStrategy``
    logs when it runs the same model as a pipeline. ``val_ppl`` (exp of the mean loss) is logged for token targets
    (integer targets with a sequence dimension). Evaluation steps then call ``pipeline_eval_step(output, target,
    stage)`` if the module defines it, as the strategy does on the last stage: one method logs a model's own metrics
    with and without the pipeline.
    """

    def pipeline_layers(self) -> Sequence[nn.Module]:
        """The ordered pipeline layers."""
        raise NotImplementedError(f"{type(self).__name__} must implement pipeline_layers()")

    def pipeline_loss(self, output: Any, target: Tensor) -> Tensor:
        """Loss of one (micro-)batch."""
        raise NotImplementedError(f"{type(self).__name__} must implement pipeline_loss(output, target)")

    def forward(self, inputs: Any) -> Any:
        """Run all layers in order."""
        with stage_forward():
            return run_layers(self.pipeline_layers(), inputs)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        """Single-process step (a pipeline strategy runs its own schedule instead)."""
        inputs, target = split_batch(self, batch)
        loss = self.pipeline_loss(self(inputs), target)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def _eval_step(self, prefix: str, batch: Any) -> None:
        inputs, target = split_batch(self, batch)
        output = self(inputs)
        loss = self.pipeline_loss(output, target)
        self.log(f"{prefix}_loss", loss, prog_bar=True)
        if not target.is_floating_point() and target.dim() >= 2:  # token targets: perplexity means something
            self.log(f"{prefix}_ppl", torch.exp(loss))
        hook = getattr(self, "pipeline_eval_step", None)
        if callable(hook):
            hook(output, target, prefix)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        """Single-process validation step."""
        self._eval_step("val", batch)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        """Single-process test step."""
        self._eval_step("test", batch)
