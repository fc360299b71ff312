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
  stage and its logs are replayed on every process (``pipeline/stage/evaluation.py``).
- ``pipeline_unused_parameters()`` on any submodule: ``True`` if a step may leave some of its trainable parameters
  without a gradient (data-parallel replicas then let DDP look for them).
- ``pipeline_whole_backward()`` on any submodule: ``True`` if a split backward (zero-bubble, V) must run its stage's
  backward whole: a parameter trained from a detached input lies on no path from the stage's inputs, which torch's
  input and weight passes follow (a Mixture-of-Depths predictor).
- ``pipeline_init_layer(index, layer)``: (re-)initialise the parameters of layer ``index`` in place. Used when layers
  are created on the meta device (Lightning's ``configure_model``) and materialised on their own stage only. Without
  it, every submodule's ``reset_parameters()`` is called.
- ``pipeline_parallelize_layer(index, layer, tp_mesh)``: split layer ``index`` over ``tp_mesh`` (the 1-D
  ``DeviceMesh`` of its stage's tensor-parallel group) in place, with torch's ``parallelize_module`` and
  ``ColwiseParallel`` / ``RowwiseParallel``, taking and returning whole hidden states. Called under
  ``DynMoStrategy(tensor_parallel_size=T)`` for every layer where it is built and again, on the meta device, for a
  layer that arrives by migration; without it the built-in plans split the reference GPT's and the Hugging Face
  layers (``pipeline/parallel/tensor_parallel.py``), and a layer left as it is runs whole on every process of its stage.

:class:`PipelineModule` is a LightningModule base class that turns the protocol into single-process ``forward``,
``training_step``, ``validation_step`` and ``test_step``, so one model class trains both with and without
``DynMoStrategy`` (under the strategy, the strategy runs the steps through the pipeline and logs the same names).

The second contract here is :class:`PipelineControl`: what callbacks may ask a pipeline strategy and tell it, in
roles: :class:`RunFacts` (the summaries), :class:`LayerEvents` (the dynamics), :class:`Rebalancing` (the balancer)
and :class:`LayerEditing` (structured pruning). ``DynMoStrategy`` gives them as ``strategy.pipeline_control``;
callbacks ask for theirs with :func:`pipeline_control` (``pipeline_control(trainer, LayerEvents)``) and never import
the strategy.

The names live in :mod:`dynmo_lightning.core`, one idea per module (the lowest layer of the package: every other
room imports it, it imports none of them); this module gathers them for users, and imports only ``core``.
"""

from dynmo_lightning.core.callback_tools import all_gather, layers_changed, local_layers
from dynmo_lightning.core.context import is_on_host, is_probing, on_host, probing, stage_forward, stage_memo
from dynmo_lightning.core.control import (
    JobShape,
    LayerEditing,
    LayerEvents,
    PipelineControl,
    PreLaunchCheck,
    Rebalancing,
    RunFacts,
    layer_editing,
    pipeline_control,
)
from dynmo_lightning.core.host_values import DeviceScalars, has_host_value, host_value, read_once, set_host_value
from dynmo_lightning.core.layer_calls import as_tuple, call_layer, run_layers, runs_without_autograd
from dynmo_lightning.core.layer_init import init_layer, layer_seed, materialise_layer
from dynmo_lightning.core.model import (
    PipelineModule,
    ProtocolError,
    check_protocol,
    may_leave_parameters_unused,
    needs_whole_backward,
    split_batch,
)
from dynmo_lightning.core.parts import held_parts, local_part

__all__ = [
    "DeviceScalars",
    "JobShape",
    "LayerEditing",
    "LayerEvents",
    "PipelineControl",
    "PipelineModule",
    "PreLaunchCheck",
    "ProtocolError",
    "Rebalancing",
    "RunFacts",
    "all_gather",
    "as_tuple",
    "call_layer",
    "check_protocol",
    "has_host_value",
    "held_parts",
    "host_value",
    "init_layer",
    "is_on_host",
    "is_probing",
    "layer_editing",
    "layer_seed",
    "layers_changed",
    "local_layers",
    "local_part",
    "materialise_layer",
    "may_leave_parameters_unused",
    "needs_whole_backward",
    "on_host",
    "pipeline_control",
    "probing",
    "read_once",
    "run_layers",
    "runs_without_autograd",
    "set_host_value",
    "split_batch",
    "stage_forward",
    "stage_memo",
]
