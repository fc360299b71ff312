"""The Trainer's plugins as the strategy runs them: precision clipping over all stages, checkpoints written atomically.

:class:`WrappedPlugins` is a mixin of the strategy: whatever precision plugin and ``CheckpointIO`` the Trainer sets,
the strategy hands out a wrapped one (:class:`~dynmo_lightning.strategy.precision.PipelinePrecision`,
:class:`~dynmo_lightning.pipeline.checkpoint.single_file.AtomicCheckpointIO`).
"""

from __future__ import annotations

from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy

from dynmo_lightning.pipeline.checkpoint.single_file import AtomicCheckpointIO
from dynmo_lightning.strategy.precision import PipelinePrecision


class WrappedPlugins(ParallelStrategy):
    """A strategy whose precision plugin clips by the norm over all stages and whose checkpoints are atomic."""

    @property  # type: ignore[override]
    def precision_plugin(self) -> PipelinePrecision:
        """The Trainer's precision plugin, wrapped so that clipping by norm uses the norm over all stages."""
        plugin = self._precision_plugin if self._precision_plugin is not None else Precision()
        if not isinstance(plugin, PipelinePrecision):
            plugin = self._precision_plugin = PipelinePrecision(plugin)
        return plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = plugin

    @property  # type: ignore[override]
    def checkpoint_io(self) -> CheckpointIO:
        """The Trainer's ``CheckpointIO``, writing atomically (``AtomicCheckpointIO``) unless it wraps itself."""
        io = ParallelStrategy.checkpoint_io.fget(self)  # type: ignore[attr-defined]
        if not isinstance(io, _WrappingCheckpointIO):
            io = self._checkpoint_io = AtomicCheckpointIO(io)
        return io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = io
