"""What a validation or test step logs under the pipeline: the loss, perplexity of token targets, the module's own.

The strategy runs the pipeline's forward itself, so the module's ``validation_step``/``test_step`` are not called;
every process logs the same values instead:

- ``{stage}_loss``: the mean micro-batch loss, shared from the last stage;
- ``{stage}_ppl``: the perplexity over every target token of the epoch (torchmetrics' ``Perplexity``: the exponent
  of the mean negative log-likelihood), for token targets (integer targets of rank 2 or more: ``[batch, seq]``
  against ``[batch, seq, vocab]`` outputs). A classifier's targets (``[batch]`` class ids) get none: its outputs are
  not per-token distributions. The last stage sums the likelihoods micro-batch by micro-batch (:class:`EvalOutput`):
  the batch's outputs are neither merged nor copied to float for it (at vocabulary 128k, batch 8 and sequence 4096
  those two are 25-35 GB);
- whatever the module's ``pipeline_eval_step(output, target, stage)`` logs (accuracy, F1, exact match...). It runs
  on the last stage, the only one with the pipeline's output (merged for the hook, and kept only for a module that
  has one); its ``self.log`` calls are recorded there, sent over the pipeline's CPU control group and replayed on
  the other stages, so every process logs the same names with the same values. A logged torchmetrics ``Metric`` is
  replayed as the same attribute of the module, which only the last stage updated: at the epoch's end its
  ``compute`` sums the states of every process (the other stages add none), which is the last stages' of all
  replicas together.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torchmetrics import Metric

from dynmo_lightning.pipeline.stage.runtime import PipelineRuntime

#: The module hook that computes and logs evaluation metrics from the pipeline's output.
EVAL_HOOK = "pipeline_eval_step"
#: Targets that are no tokens (padding), as ``torch.nn.functional.cross_entropy`` ignores them.
IGNORE_INDEX = -100


def token_targets(target: Tensor) -> bool:
    """Whether ``target`` holds token ids (integers with a sequence dimension): what perplexity is defined for."""
    return not target.is_floating_point() and target.dim() >= 2


@dataclasses.dataclass
class EvalOutput:
    """What the last stage keeps of one evaluation batch, added micro-batch by micro-batch (:meth:`add`).

    Args:
        keeps_outputs: whether the outputs are kept (merged by the schedule into :attr:`output`): only for the
            module's ``pipeline_eval_step``, which needs them.
    """

    keeps_outputs: bool
    #: The merged outputs of the batch (``None`` unless kept).
    output: Any = None
    #: Sum of the negative log-likelihood of every target token so far (``None``: no token targets).
    nll: Tensor | None = None
    #: Target tokens so far (those equal to PyTorch's ignore index, -100, are not targets).
    tokens: Tensor | None = None

    @classmethod
    def of(cls, module: Any) -> EvalOutput:
        """An empty one for ``module`` (it keeps outputs where ``module`` has the hook that reads them)."""
        return cls(keeps_outputs=callable(getattr(module, EVAL_HOOK, None)))

    def add(self, output: Any, target: Tensor) -> None:
        """Count one micro-batch's output against its targets (on the device: nothing is read)."""
        if not token_targets(target):
            return
        logits = output[0] if isinstance(output, tuple) else output
        # One micro-batch's logits in float at a time; the sums torchmetrics' ``Perplexity`` takes.
        nll = F.cross_entropy(logits.float().flatten(0, -2), target.flatten(), reduction="sum")
        tokens = (target != IGNORE_INDEX).sum()
        self.nll = nll if self.nll is None else self.nll + nll
        self.tokens = tokens if self.tokens is None else self.tokens + tokens


class PipelineEvaluation:
    """Logs one evaluation step's values on every process of the pipeline, the same everywhere.

    Each step is logged for the runtime that ran it (its pipeline, and which process holds the last stage, change
    when layers move or the world changes).
    """

    def __init__(self) -> None:
        self._perplexity: dict[str, Any] = {}

    def log(
        self,
        module: Any,
        stage: str,
        loss: Tensor,
        output: EvalOutput | None,
        target: Tensor,
        batch_size: int,
        runtime: PipelineRuntime,
    ) -> None:
        """Log ``stage``'s loss, perplexity (token targets) and the module's own metrics (collective over the pipeline).

        Args:
            module: the LightningModule.
            stage: ``"val"`` or ``"test"``.
            loss: the step's loss (on every process).
            output: what the last stage kept of the batch (``None`` elsewhere).
            target: the batch's targets.
            batch_size: samples in the batch.
            runtime: the runtime that ran the step (its pipeline; where the last stage is).
        """
        # Every process holds the same value; syncing makes Lightning's epoch mean explicit (and cheap).
        log = {"on_step": False, "on_epoch": True, "batch_size": batch_size}
        module.log(f"{stage}_loss", loss, prog_bar=True, sync_dist=True, **log)
        if token_targets(target):
            metric = self._token_perplexity(stage, runtime.pipe.device)
            if output is not None and output.nll is not None and output.tokens is not None:
                metric.update(output.nll, output.tokens)
            else:  # the other stages add nothing to the sums every process's metric is reduced over
                metric.update(torch.zeros((), device=runtime.pipe.device), 0)
            module.log(f"{stage}_ppl", metric, metric_attribute=f"_dynmo_{stage}_ppl", **log)
        hook = getattr(module, EVAL_HOOK, None)
        if callable(hook):
            self._module_metrics(module, hook, stage, output.output if output is not None else None, target, runtime)

    def _token_perplexity(self, stage: str, device: torch.device) -> TokenPerplexity:
        if stage not in self._perplexity:
            self._perplexity[stage] = TokenPerplexity().to(device)
        return self._perplexity[stage]

    def _module_metrics(
        self, module: Any, hook: Callable, stage: str, output: Any, target: Tensor, runtime: PipelineRuntime
    ) -> None:
        """Run the module's hook on the last stage, recording its logs; replay them everywhere else."""
        pipe, last = runtime.pipe, runtime.has_last_stage
        records: list[Any] = []
        if last:
            with _recording(module, records):
                hook(output, target, stage)
        if pipe.size == 1:
            return
        payload = [records if last else None]
        dist.broadcast_object_list(payload, src=runtime.last_global_rank, group=pipe.control)
        if not last:
            with warnings.catch_warnings():
                # This stage never updates the replayed metrics: torchmetrics would say so at every compute.
                warnings.filterwarnings("ignore", message=r".*``compute`` method of metric .* before the ``update``")
                for name, value, args, kwargs in payload[0]:
                    module.log(name, _replayed(module, value, pipe.device), *args, **kwargs)


class TokenPerplexity(Metric):
    """torchmetrics' ``Perplexity`` from sums that were taken micro-batch by micro-batch (:class:`EvalOutput`).

    ``exp(nll / tokens)`` over everything added, on every process (its sums are reduced over all of them).
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False
    nll: Tensor
    tokens: Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("nll", default=torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("tokens", default=torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, nll: Tensor, tokens: Tensor | int) -> None:
        """Add a sum of negative log-likelihoods of ``tokens`` target tokens."""
        self.nll += nll
        self.tokens += tokens

    def compute(self) -> Tensor:
        """The perplexity of every token added."""
        return torch.exp(self.nll / self.tokens)


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
    return isinstance(value, Metric)
