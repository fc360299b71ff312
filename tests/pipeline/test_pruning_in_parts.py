"""Structured pruning of layers held in parts (FSDP2, replicate, tensor parallelism), exact against one pipeline.

A pruned layer held in parts is gathered whole with its optimizer state, pruned, and made parts again
(``pipeline/stage/reshape.py``). P = 2 x D = 2 (``fsdp``, ``replicate``) and P = 2 x T = 2 on 4 gloo processes against P
= 2 of the same global batch (fp32, relative <= 1e-5 per step and on the final parameters), global structured pruning
every 5 steps from step 5 with layers moving to a random split every 5 steps: the same units go everywhere (in multiples
of 2, which T = 2 needs and the reference is told), the same shapes, the same math.
"""

from __future__ import annotations

import pytest
from support.helpers import DP2, RANDOM, assert_close_losses, assert_close_model, assert_close_params, launch, slow

PRUNE = [
    "dynamics=pruning",
    "dynamics.start_step=5",
    "dynamics.end_step=15",
    "dynamics.every_n_steps=5",
    "dynamics.multiple_of=2",
    "trainer.max_steps=16",
    *RANDOM,
]
MODES = {
    "fsdp": [*DP2, "strategy.data_parallel=fsdp"],
    "replicate": [*DP2, "strategy.data_parallel=replicate"],
    "tp2": ["strategy.tensor_parallel_size=2"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("pruning_in_parts")
    out = launch(2, {d / "pp2": PRUNE})
    out |= launch(4, {d / name: [*settings, *PRUNE] for name, settings in MODES.items()})
    return {path.name: run for path, run in out.items()}


@slow
@pytest.mark.parametrize("name", list(MODES))
def test_structured_pruning_of_layers_held_in_parts_equals_one_pipeline(runs, name):
    ref, run = runs["pp2"], runs[name]
    a, b = ref.checkpoint["state_dict"], run.checkpoint["state_dict"]
    assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}  # the same units went
    hidden = [a[f"blocks.{i}.mlp.fc.weight"].shape[0] for i in range(4)]
    heads = [a[f"blocks.{i}.attn.q.weight"].shape[0] // 8 for i in range(4)]  # the tiny GPT: heads of 8
    assert sum(hidden) < 4 * 128 and sum(heads) <= 4 * 4  # pruned ...
    assert all(n % 2 == 0 for n in (*hidden, *heads))  # ... in multiples of 2
    assert len(run.summary["partitions"]) >= 3  # pruned layers moved too
    assert_close_losses(run.summary["losses"], ref.summary["losses"])
    assert_close_model(b, a)
    assert_close_params(b, a, rtol=1e-4)
