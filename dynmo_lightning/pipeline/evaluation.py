"""What a validation or test step logs under the pipeline: the loss, perplexity of token targets, the module's own.

The strategy runs the pipeline's forward itself, so the module's ``validation_step``/``test_step`` are not called;
every process logs the same values instead:

- ``{stage}_loss``: the mean micro-batch loss, shared from the last stage;
- ``{stage}_ppl``: torchmetrics' ``Perplexity`` over every target token of the epoch, for token targets
  (integer targets of rank 2 or more: ``[batch, seq]`` against ``[batch, seq, vocab]`` outputs). A classifier's
  targets (``[batch]`` class ids) get none: its outputs are not per-token distributions;
- whatever the module's ``pipeline_eval_step(output, target, stage)`` logs (accuracy, F1, exact match...). It runs
  on the last stage, the only one with the pipeline's output; its ``self.log`` calls are recorded there, sent over
  the pipeline's CPU control group and replayed on the other stages, so every process logs the same names with the
  same values. A logged torchmetrics ``Metric`` is replayed as the same attribute of the module, which only the last
  stage updated: at the epoch's end its ``compute`` sums the states of every process (the other stages add none),
  which is the last stages' of all replicas together.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dynmo_lightning.pipeline.layout import PipelineGroup
from dynmo_lightning.pipeline.reduce import last_stage_perplexity

#: The module hook that computes and logs evaluation metrics from the pipeline's output.
EVAL_HOOK = "pipeline_eval_step"


def token_targets(target: Tensor) -> bool:
    """Whether ``target`` holds token ids (integers with a sequence dimension): what perplexity is defined for."""
    return not target.is_floating_point() and target.dim() >= 2


class PipelineEvaluation:
    """Logs one evaluation step's values on every process of the pipeline, the same everywhere.

    Args:
        pipe: returns this process's pipeline (its groups change when the world shrinks).
        has_last_stage: returns whether this process holds the last stage.
        last_rank: returns the pipeline rank of the last stage.
    """

    def __init__(
        self, pipe: Callable[[], PipelineGroup], has_last_stage: Callable[[], bool], last_rank: Callable[[], int]
    ) -> None:
        self._pipe, self._has_last, self._last_rank = pipe, has_last_stage, last_rank
        self._perplexity: dict[str, Any] = {}

    def log(self, module: Any, stage: str, loss: Tensor, output: Any, target: Tensor, batch_size: int) -> None:
        """Log ``stage``'s loss, perplexity (token targets) and the module's own metrics (collective over the pipeline).

        Args:
            module: the LightningModule.
            stage: ``"val"`` or ``"test"``.
            loss: the step's loss (on every process).
            output: the last stage's output (``None`` elsewhere).
            target: the batch's targets.
            batch_size: samples in the batch.
        """
        # Every process holds the same value; syncing makes Lightning's epoch mean explicit (and cheap).
        log = {"on_step": False, "on_epoch": True, "batch_size": batch_size}
        module.log(f"{stage}_loss", loss, prog_bar=True, sync_dist=True, **log)
        if token_targets(target):
            metric = self._token_perplexity(stage)
            if self._has_last():
                metric.update((output[0] if isinstance(output, tuple) else output).float(), target)
            module.log(f"{stage}_ppl", metric, metric_attribute=f"_dynmo_{stage}_ppl", **log)
        hook = getattr(module, EVAL_HOOK, None)
        if callable(hook):
            self._module_metrics(module, hook, stage, output, target)

    def _token_perplexity(self, stage: str) -> Any:
        if stage not in self._perplexity:
            self._perplexity[stage] = last_stage_perplexity(self._has_last(), self._pipe().device)
        return self._perplexity[stage]

    def _module_metrics(self, module: Any, hook: Callable, stage: str, output: Any, target: Tensor) -> None:
        """Run the module's hook on the last stage, recording its logs; replay them everywhere else."""
        pipe, last = self._pipe(), self._has_last()
        records: list[Any] = []
        if last:
            with _recording(module, records):
                hook(output, target, stage)
        if pipe.size == 1:
            return
        payload = [records if last else None]
        dist.broadcast_object_list(payload, src=pipe.global_rank(self._last_rank()), group=pipe.control)
        if not last:
            with warnings.catch_warnings():
                # This stage never updates the replayed metrics: torchmetrics would say so at every compute.
                warnings.filterwarnings("ignore", message=r".*``compute`` method of metric .* before the ``update``")
                for name, value, args, kwargs in payload[0]:
                    module.log(name, _replayed(module, value, pipe.device), *args, **kwargs)


class _recording:
    """Within: the module's ``log`` calls go through as usual and are recorded as host data."""

    def __init__(self, module: Any, records: list[Any]) -> None:
        self._module, self._records = module, records
        self._metrics = {id(m): name for name, m in module.named_modules() if _is_metric(m)}

    def __enter__(self) -> None:
        original = self._module.log

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            self._records.append((name, self._as_host_data(value), args, kwargs))
            original(name, value, *args, **kwargs)

        self._module.log = log  # an instance attribute shadows the method until __exit__

    def __exit__(self, *exc: object) -> None:
        del self._module.log

    def _as_host_data(self, value: Any) -> Any:
        if _is_metric(value):
            if id(value) not in self._metrics:
                raise ValueError(
                    f"pipeline_eval_step logged a {type(value).__name__} that is not an attribute of the module: "
                    "make it one (self.acc = Accuracy(...)), so that every pipeline stage logs the same metric"
                )
            return ("metric", self._metrics[id(value)])
        if isinstance(value, Tensor):
            return value.detach().cpu()  # one read per logged value, in evaluation only
        return value


def _replayed(module: Any, value: Any, device: torch.device) -> Any:
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "metric":
        return module.get_submodule(value[1])
    return value.to(device) if isinstance(value, Tensor) else value


def _is_metric(value: Any) -> bool:
    from torchmetrics import Metric

    return isinstance(value, Metric)
