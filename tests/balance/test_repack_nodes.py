"""The repack planner frees whole nodes: the kept ranks fill the fewest nodes, then move the fewest bytes."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynmo_lightning.balance import plan_repack
from dynmo_lightning.balance.decision.repack import _keep_ranks_on_nodes


def _brute_force(current, proposed, layer_bytes, nodes):
    """Every ascending set of kept ranks starting with rank 0: the most freed nodes, then the fewest bytes moved."""
    owner = [r for r, n in enumerate(current) for _ in range(n)]
    best = None
    for rest in itertools.combinations(range(1, len(current)), len(proposed) - 1):
        keep = [0, *rest]
        start, stay = 0, 0.0
        for s, n in enumerate(proposed):
            stay += sum(layer_bytes[i] for i in range(start, start + n) if owner[i] == keep[s])
            start += n
        freed = len(set(nodes) - {nodes[r] for r in keep})
        key = (-freed, sum(layer_bytes) - stay)
        best = key if best is None or key < best else best
    return best


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_kept_ranks_free_the_most_nodes_then_move_the_fewest_bytes(data):
    n_ranks = data.draw(st.integers(2, 7))
    per_node = data.draw(st.integers(1, 3))
    nodes = [f"n{r // per_node}" for r in range(n_ranks)]
    current = data.draw(st.lists(st.integers(1, 3), min_size=n_ranks, max_size=n_ranks))
    n_layers = sum(current)
    n_new = data.draw(st.integers(1, n_ranks - 1))
    cuts = sorted(data.draw(st.sets(st.integers(1, n_layers - 1), min_size=n_new - 1, max_size=n_new - 1)))
    proposed = [b - a for a, b in zip([0, *cuts], [*cuts, n_layers], strict=True)]
    layer_bytes = data.draw(st.lists(st.integers(1, 9), min_size=n_layers, max_size=n_layers))
    keep, moved = _keep_ranks_on_nodes(current, proposed, [float(b) for b in layer_bytes], nodes)
    assert keep[0] == 0 and keep == sorted(set(keep)) and len(keep) == n_new
    freed = len(set(nodes) - {nodes[r] for r in keep})
    assert (-freed, moved) == _brute_force(current, proposed, layer_bytes, nodes)


def test_a_repack_keeps_the_survivors_on_one_node_and_names_the_freed_one():
    # 4 ranks on two nodes; layers 0-3 frozen (forward only), so two stages do. Without nodes the byte-optimal
    # survivors are ranks 0 and 2 (one per node: nothing is freed for the scheduler); with nodes, ranks 0 and 1.
    fwd, bwd = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0, 2.0, 2.0]
    current, layer_bytes = [2, 1, 2, 1], [1.0, 1.0, 1.0, 1.0, 9.0, 1.0]
    kw = {"n_microbatches": 4, "tolerance": 0.6, "min_stages": 2, "layer_bytes": layer_bytes}
    plain = plan_repack(fwd, bwd, current, **kw)
    assert plain is not None and plain.keep_ranks == [0, 2] and plain.freed_nodes == []
    plan = plan_repack(fwd, bwd, current, nodes=["a", "a", "b", "b"], **kw)
    assert plan is not None and plan.keep_ranks == [0, 1] and plan.freed_nodes == ["b"]
    assert plan.layers_per_stage == plain.layers_per_stage and plan.bytes_moved > plain.bytes_moved


def test_nodes_must_name_every_rank():
    with pytest.raises(ValueError, match="nodes has 3 entries for 2 ranks"):
        plan_repack([1.0, 1.0], [1.0, 1.0], [1, 1], n_microbatches=2, tolerance=1.0, nodes=["a", "a", "b"])
