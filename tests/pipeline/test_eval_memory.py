"""Evaluation keeps one micro-batch's logits at a time: perplexity is summed per micro-batch on the last stage.

Before, the last stage merged the whole batch's logits, kept every micro-batch's output in torch's stage cache until
the next step, and copied the merged logits to float for torchmetrics' ``Perplexity`` (25-35 GB at vocabulary 128k,
batch 8, sequence 4096). Outputs are kept only for a module's ``pipeline_eval_step``, which reads them.
"""

from __future__ import annotations

import pytest
import torch
from torchmetrics.text import Perplexity

from dynmo_lightning.models import GPT
from dynmo_lightning.pipeline.stage.evaluation import PipelineEvaluation
from dynmo_lightning.pipeline.stage.local import LocalStages
from tests.support.memory import PeakBytes
from tests.support.stages import one_process_stages

pytestmark = pytest.mark.timeout(120)

VOCAB, BATCH, SEQ = 4096, 8, 32
LOGITS = BATCH * SEQ * VOCAB * 4  # bytes of the batch's float logits (4 MiB)


class _Logs(torch.nn.Module):
    """A module's ``log`` as the evaluation calls it (values by name)."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: dict[str, object] = {}

    def log(self, name: str, value: object, *args: object, **kwargs: object) -> None:
        self.logged[name] = value


def _evaluate(stages: LocalStages, x: torch.Tensor, y: torch.Tensor) -> tuple[PeakBytes, _Logs, torch.Tensor]:
    evaluation = PipelineEvaluation()
    logs = _Logs()
    if hasattr(stages.module, "pipeline_eval_step"):  # the strategy hands the evaluation the same module
        logs.pipeline_eval_step = stages.module.pipeline_eval_step
    with torch.no_grad(), PeakBytes() as memory:
        loss, result = stages.evaluate(x, y)
        evaluation.log(logs, "val", loss, result.output, y, BATCH, stages.runtime)
        del result
    return memory, logs, loss


def test_evaluation_holds_one_micro_batch_of_logits_and_its_perplexity_is_exact(one_process_world):
    torch.manual_seed(0)
    model = GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_embd=32, n_head=4)
    reference = GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_embd=32, n_head=4)
    reference.load_state_dict(model.state_dict())
    stages = one_process_stages(model)
    x, y = torch.randint(0, VOCAB, (BATCH, SEQ)), torch.randint(0, VOCAB, (BATCH, SEQ))
    for _ in range(2):  # the second step finds the stages built
        memory, logs, loss = _evaluate(stages, x, y)
        # Before: peak 12.6 MB (3 x the batch's logits: the stage cache, the merge, the float copy and the
        # softmax), and 4.2 MB still held after the step (torch's stage cache). Now 2.1 MB and nothing.
        assert memory.peak < LOGITS and memory.live < LOGITS / 4, (memory.peak, memory.live)
    with torch.no_grad():
        logits = reference(x)
    expected = Perplexity()(logits, y)
    torch.testing.assert_close(logs.logged["val_ppl"].compute(), expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()))


def test_a_module_with_pipeline_eval_step_still_gets_the_batch_outputs(one_process_world):
    torch.manual_seed(0)
    model = GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_embd=32, n_head=4)
    seen: list[tuple[tuple[int, ...], str]] = []
    model.pipeline_eval_step = lambda output, target, stage: seen.append((tuple(output.shape), stage))
    stages = one_process_stages(model)
    x, y = torch.randint(0, VOCAB, (BATCH, SEQ)), torch.randint(0, VOCAB, (BATCH, SEQ))
    _, logs, _ = _evaluate(stages, x, y)
    assert seen == [((BATCH, SEQ, VOCAB), "val")] and "val_ppl" in logs.logged
