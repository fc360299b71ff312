"""Which layers this process holds, and where each layer lives inside the user's LightningModule.

A pipeline stage owns a contiguous run of the model's ``pipeline_layers()``. Layers owned by other stages are replaced,
in the user's module tree, by :class:`RemoteLayer` placeholders that hold no parameters: the module's
``parameters()``, ``state_dict()`` and the optimizer built by ``configure_optimizers`` then see only local layers,
with the unsplit model's parameter names. Moving a layer in or out swaps the real module and the placeholder in
every slot the layer occupies.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from torch import Tensor, nn

from dynmo_lightning.core.context import is_probing, stage_forward
from dynmo_lightning.core.layer_calls import call_layer
from dynmo_lightning.profiling import LayerProfiler
from dynmo_lightning.recompute import checkpointed_call, shared_recomputation


class RemoteLayer(nn.Module):
    """Stand-in for a layer that lives on another pipeline stage (no parameters, cannot run)."""

    #: Marks a placeholder for :func:`dynmo_lightning.protocol.local_layers`.
    pipeline_remote = True

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def forward(self, *args: object) -> None:
        """Refuse to run: the layer's weights are on another process."""
        raise RuntimeError(
            f"Pipeline layer {self.index} lives on another stage. Under DynMoStrategy the model runs through the "
            "pipeline schedule; call the Trainer (fit/validate/test/predict) instead of the module's forward."
        )

    def extra_repr(self) -> str:
        """Show the layer index in the module tree."""
        return f"index={self.index}"


class StageModule(nn.Module):
    """The layers of one pipeline stage, run in order; what ``torch.distributed.pipelining`` wraps.

    Args:
        layers: the stage's layers, in order.
        first_index: global index of the first layer.
        profiler: times the layers while it is active (not during shape probes).
        recompute: global indices of the layers that run under activation checkpointing
            (:mod:`~dynmo_lightning.recompute`): called through it, not wrapped, so the modules stay the model's.
        split_backward: the schedule runs backward as an input and a weight pass (zero-bubble): a checkpointed
            layer recomputes once for both (:func:`~dynmo_lightning.recompute.shared_recomputation`).
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        first_index: int,
        profiler: LayerProfiler | None = None,
        recompute: Collection[int] = frozenset(),
        split_backward: bool = False,
    ) -> None:
        super().__init__()
        self.split_backward = split_backward
        self.layers = nn.ModuleList(layers)
        self.first_index = first_index
        self.profiler = profiler
        self.recompute = frozenset(recompute)

    def forward(self, *args: object) -> object:
        """Run the stage's layers on the received activations."""
        x = args if len(args) != 1 else args[0]
        with stage_forward(), shared_recomputation(self.split_backward):
            if self.profiler is not None and self.profiler.active and not is_probing():
                out = self.profiler.run(self.layers, self.first_index, x, self.recompute)
            else:
                out = x
                for index, layer in enumerate(self.layers, self.first_index):
                    out = checkpointed_call(layer, out) if index in self.recompute else call_layer(layer, out)
        # p2p sends need dense, contiguous tensors; a layer may legally return a view.
        if isinstance(out, tuple):
            return tuple(self._sendable(t) for t in out)
        return self._sendable(out)

    def _sendable(self, t: Tensor) -> Tensor:
        """``t`` contiguous; and, under a split backward, not a view.

        torch's input pass detaches the stage's outputs in place, which a view refuses: an input passed through
        unchanged (every token exited before the stage) is one under FSDP2, whose pre-forward returns the inputs as
        views of themselves.
        """
        t = t.contiguous()
        return t.clone() if self.split_backward and t._is_view() else t


class LayerSlots:
    """The places (parent module, attribute) where each pipeline layer sits in the user's module tree.

    Args:
        root: the LightningModule.
        layers: its ``pipeline_layers()``.

    """

    def __init__(self, root: nn.Module, layers: Sequence[nn.Module]) -> None:
        self.n_layers = len(layers)
        index_of = {id(layer): i for i, layer in enumerate(layers)}
        self.slots: list[list[tuple[nn.Module, str]]] = [[] for _ in layers]
        self.names: list[str] = [""] * len(layers)
        for parent_name, parent in root.named_modules(remove_duplicate=False):
            for attr, child in parent._modules.items():
                i = index_of.get(id(child))
                if i is None:
                    continue
                self.slots[i].append((parent, attr))
                if not self.names[i]:
                    self.names[i] = f"{parent_name}.{attr}" if parent_name else attr
        orphans = [i for i, s in enumerate(self.slots) if not s]
        if orphans:
            raise TypeError(
                f"pipeline_layers() returned layers {orphans} that are not submodules of {type(root).__name__}. "
                "Register every layer on the module (e.g. in an nn.ModuleList attribute) so that its parameters are "
                "saved in checkpoints and seen by the optimizer."
            )
        self.modules: list[nn.Module | None] = list(layers)

    def get(self, index: int) -> nn.Module:
        """The real module of a local layer."""
        module = self.modules[index]
        if module is None:
            raise KeyError(f"layer {index} is not held by this process")
        return module

    def is_local(self, index: int) -> bool:
        """Whether this process holds layer ``index``."""
        return self.modules[index] is not None

    def install(self, index: int, module: nn.Module) -> None:
        """Put the real ``module`` of layer ``index`` into all its slots."""
        for parent, attr in self.slots[index]:
            parent._modules[attr] = module
        self.modules[index] = module

    def remove(self, index: int) -> nn.Module:
        """Replace layer ``index`` by a placeholder everywhere and return the real module."""
        module = self.get(index)
        placeholder = RemoteLayer(index)
        for parent, attr in self.slots[index]:
            parent._modules[attr] = placeholder
        self.modules[index] = None
        return module

    def local_indices(self) -> list[int]:
        """Indices of the layers this process holds, in order."""
        return [i for i, m in enumerate(self.modules) if m is not None]
