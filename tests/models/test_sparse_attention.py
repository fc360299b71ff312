"""SparseCausalSelfAttention: dense exactness, block selection, cost, adaptive density, checkpoints, errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from dynmo_lightning.models.gpt import CausalSelfAttention
from dynmo_lightning.models.sparse_attention import SparseCausalSelfAttention
from dynmo_lightning.protocol import probing

C, H = 32, 4


def _sparse(seed: int = 0, **kwargs) -> SparseCausalSelfAttention:
    torch.manual_seed(seed)
    return SparseCausalSelfAttention(C, H, 0.0, True, **kwargs).eval()


def _kept_mask(q: torch.Tensor, k: torch.Tensor, density: float, blk: int) -> torch.Tensor:
    """Reference selection, written as a plain loop: ``(B, H, T, T)`` mask of the kept causal entries."""
    B, n_head, T, _ = q.shape
    n = T // blk
    qp, kp = q.detach().view(B, n_head, n, blk, -1).mean(3), k.detach().view(B, n_head, n, blk, -1).mean(3)
    blocks = torch.zeros(B, n_head, n, n, dtype=torch.bool)
    for b in range(B):
        for h in range(n_head):
            for i in range(n):
                n_kept = max(1, min(i + 1, math.floor(density * (i + 1) + 0.5)))
                earlier = sorted(range(i), key=lambda j: (-float(qp[b, h, i] @ kp[b, h, j]), j))
                for j in [i, *earlier[: n_kept - 1]]:
                    blocks[b, h, i, j] = True
    return blocks.repeat_interleave(blk, 2).repeat_interleave(blk, 3) & torch.ones(T, T, dtype=torch.bool).tril()


def _qkv(m: SparseCausalSelfAttention, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return m.qkv(x)


def _masked_attention(m: SparseCausalSelfAttention, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    B, T, _ = x.shape
    q, k, v = _qkv(m, x)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return m.proj(y.transpose(1, 2).reshape(B, T, -1))


def test_density_one_is_bit_identical_to_dense_attention():
    torch.manual_seed(0)
    dense = CausalSelfAttention(C, H, 0.0, True)
    sparse = SparseCausalSelfAttention(C, H, 0.0, True, attn_block=16, density=1.0)
    sparse.load_state_dict(dense.state_dict())
    x = torch.randn(2, 64, C)
    assert torch.equal(sparse(x), dense(x))
    assert sparse.last_block_fraction == 1.0


def test_all_blocks_kept_takes_dense_path():
    # Two blocks at density 0.8: k = [1, round(1.6)=2] keeps every causal block, so the dense path runs.
    torch.manual_seed(0)
    dense = CausalSelfAttention(C, H, 0.0, True)
    sparse = SparseCausalSelfAttention(C, H, 0.0, True, attn_block=16, density=0.8)
    sparse.load_state_dict(dense.state_dict())
    x = torch.randn(1, 32, C)
    assert sparse.blocks_kept(2) == [1, 2]
    assert torch.equal(sparse(x), dense(x))
    # A sequence no longer than one block is one (diagonal) block: dense too.
    assert torch.equal(sparse(x[:, :10]), dense(x[:, :10]))


@pytest.mark.parametrize("density", [0.3, 0.5, 0.75])
def test_sparse_path_matches_masked_dense_reference(density):
    m = _sparse(attn_block=8, density=density)
    x = torch.randn(2, 64, C)
    q, k, _ = _qkv(m, x)
    expected = _masked_attention(m, x, _kept_mask(q, k, density, 8))
    torch.testing.assert_close(m(x), expected, rtol=1e-5, atol=1e-6)


def test_minimal_density_is_block_diagonal_attention():
    m = _sparse(attn_block=8, density=0.01)
    x = torch.randn(1, 32, C)
    assert m.blocks_kept(4) == [1, 1, 1, 1]
    mask = torch.block_diag(*[torch.ones(8, 8, dtype=torch.bool).tril()] * 4)
    torch.testing.assert_close(m(x), _masked_attention(m, x, mask), rtol=1e-5, atol=1e-6)
    assert m.last_block_fraction == pytest.approx(4 / 10)


def test_selection_depends_on_data_per_head():
    m = _sparse(attn_block=8, density=0.5)
    q, k, _ = _qkv(m, torch.randn(1, 64, C))
    mask = _kept_mask(q, k, 0.5, 8)
    assert not all(torch.equal(mask[0, 0], mask[0, h]) for h in range(1, H))


def test_gradients_flow_through_sparse_path():
    m = _sparse(attn_block=8, density=0.5).train()
    x = torch.randn(2, 64, C, requires_grad=True)
    m(x).square().sum().backward()
    assert all(lin.weight.grad.abs().sum() > 0 for lin in (m.q, m.k, m.v)) and x.grad.abs().sum() > 0


def _cpu_sdpa_flops(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    # FlopCounterMode has no formula for the CPU fused kernel: two matmuls of (L x D) by (D x S).
    b, h, length, d = q_shape
    return 4 * b * h * length * k_shape[2] * d


def _attention_flops(m: SparseCausalSelfAttention, x: torch.Tensor) -> tuple[int, int]:
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping={op: _cpu_sdpa_flops}) as counter:
        m(x)
    return counter.get_total_flops(), counter.get_flop_counts()["Global"].get(op, 0)


def test_flops_fall_with_density_at_long_sequence():
    torch.manual_seed(0)
    x = torch.randn(1, 1024, C)
    blk, n, head_dim = 64, 16, C // H
    totals, attention = {}, {}
    for density in (1.0, 0.5, 0.25, 0.1):
        m = _sparse(attn_block=blk, density=density)
        totals[density], attention[density] = _attention_flops(m, x)
        if density < 1:
            # Exactly the kept blocks are computed.
            assert attention[density] == 4 * H * blk * blk * head_dim * sum(m.blocks_kept(n))
            assert m.last_block_fraction == pytest.approx(sum(m.blocks_kept(n)) / (n * (n + 1) / 2))
    assert totals[1.0] > totals[0.5] > totals[0.25] > totals[0.1]
    # The dense kernel computes (and is counted for) the full T x T scores; kept blocks are a share of the causal half.
    assert attention[1.0] == 4 * H * 1024 * 1024 * head_dim
    assert attention[0.1] < attention[0.25] < attention[0.5] < 0.3 * attention[1.0]


def test_adaptive_density_moves_towards_target():
    x = torch.randn(1, 128, C)
    # Everything kept: coverage 1 > target, so density falls by adapt_rate * (target - 1).
    m = _sparse(attn_block=16, density=1.0, target_coverage=0.5, adapt_rate=0.1).train()
    m(x)
    m.adapt()
    assert float(m.density) == pytest.approx(0.95)
    assert m.last_coverage == 1.0

    # Near-uniform attention at init: a low density covers little mass, so density rises.
    m = _sparse(attn_block=16, density=0.2, target_coverage=0.99).train()
    m(x)
    m.adapt()
    assert 0 < m.last_coverage < 0.99
    assert float(m.density) == pytest.approx(0.2 + 0.1 * (0.99 - m.last_coverage))

    # Clamped at min_density.
    m = _sparse(attn_block=16, density=0.1, target_coverage=0.01, min_density=0.08, adapt_rate=1.0).train()
    m(x)
    m.adapt()
    assert float(m.density) == pytest.approx(0.08)

    # Repeated steps converge: density keeps moving in the direction that shrinks the coverage error.
    m = _sparse(attn_block=16, density=1.0, target_coverage=0.6, adapt_rate=0.5).train()
    densities = []
    for _ in range(6):
        m(x)
        m.adapt()
        densities.append(float(m.density))
    assert densities[-1] < 1.0 and abs(m.last_coverage - 0.6) < 0.4

    # Two forwards in one step (two micro-batches): one update, by the summed coverage errors, and the mean coverage.
    m = _sparse(attn_block=16, density=0.2, target_coverage=0.99).train()
    m(x)
    m(x)
    assert float(m.density) == pytest.approx(0.2), "the density stays fixed within a step"
    coverage = float(m._coverage_sum) / 2
    m.adapt()
    assert m.last_coverage == pytest.approx(coverage)
    assert float(m.density) == pytest.approx(0.2 + 0.1 * 2 * (0.99 - coverage))


def test_coverage_matches_exact_attention_mass_of_sampled_rows():
    blk, density = 8, 0.5
    m = _sparse(attn_block=blk, density=density, target_coverage=0.9).train()
    x = torch.randn(2, 64, C)
    with torch.no_grad():
        q, k, _ = _qkv(m, x)
    mask = _kept_mask(q, k, density, blk)
    probs = (
        (q @ k.transpose(-1, -2) / math.sqrt(C // H))
        .masked_fill(~torch.ones(64, 64, dtype=torch.bool).tril(), -math.inf)
        .softmax(-1)
    )
    rows = slice(blk - 1, None, blk)
    expected = (probs[:, :, rows] * mask[:, :, rows]).sum(-1).mean()
    m(x)
    m.adapt()
    assert m.last_coverage == pytest.approx(float(expected), abs=1e-5)


def test_density_is_fixed_in_eval_without_target_and_while_probing():
    x = torch.randn(1, 64, C)
    m = _sparse(attn_block=16, density=0.5, target_coverage=0.9)
    m(x)  # eval
    assert float(m.density) == 0.5
    fixed = _sparse(attn_block=16, density=0.5).train()
    fixed(x)
    assert float(fixed.density) == 0.5
    m.train()
    with probing():
        m(x)
    assert float(m.density) == 0.5 and math.isnan(m.last_coverage)


def test_state_dict_compatible_with_dense_attention():
    dense = CausalSelfAttention(C, H, 0.0, True)
    sparse = SparseCausalSelfAttention(C, H, 0.0, True, density=0.3)
    assert set(sparse.state_dict()) == set(dense.state_dict()) | {"density"}
    # Dense -> sparse loads strictly and keeps the layer's own density.
    sparse.load_state_dict(dense.state_dict())
    assert float(sparse.density) == pytest.approx(0.3)
    # Sparse -> dense needs strict=False for the extra buffer.
    result = dense.load_state_dict(sparse.state_dict(), strict=False)
    assert result.unexpected_keys == ["density"] and not result.missing_keys
    # The drifted density is checkpointed.
    other = SparseCausalSelfAttention(C, H, 0.0, True, density=1.0)
    other.load_state_dict(sparse.state_dict())
    assert float(other.density) == pytest.approx(0.3)


def test_materialised_from_meta_resets_density():
    with torch.device("meta"):
        m = SparseCausalSelfAttention(C, H, 0.0, True, density=0.4)
    m.to_empty(device="cpu")
    m.reset_parameters()
    assert float(m.density) == pytest.approx(0.4)


def test_head_pruning_keeps_sparse_attention_working():
    m = _sparse(attn_block=8, density=0.5)
    m.keep_units(torch.tensor([0, 2]))
    x = torch.randn(1, 32, C)
    q, k, _ = _qkv(m, x)
    torch.testing.assert_close(m(x), _masked_attention(m, x, _kept_mask(q, k, 0.5, 8)), rtol=1e-5, atol=1e-6)


def test_sequence_not_multiple_of_block():
    m = _sparse(attn_block=64, density=0.5)
    with pytest.raises(ValueError, match=r"sequence length 1000 is not a multiple of model\.attn_block=64"):
        m(torch.randn(1, 1000, C))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"density": 0.0}, r"model\.attn_density=0\.0"),
        ({"density": 1.5}, r"model\.attn_density=1\.5"),
        ({"target_coverage": 0.0}, r"model\.attn_target_coverage=0\.0"),
        ({"target_coverage": 1.2}, r"model\.attn_target_coverage=1\.2"),
        ({"attn_block": 0}, r"model\.attn_block=0"),
    ],
)
def test_invalid_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SparseCausalSelfAttention(C, H, 0.0, True, **kwargs)


def test_coverage_is_the_attention_mass_of_the_kept_blocks():
    from dynmo_lightning.models.sparse_attention import _coverage, _rank_earlier_blocks

    torch.manual_seed(0)
    B, H, blk, n, D = 2, 2, 4, 5, 8
    q, k = torch.randn(B, H, n * blk, D), torch.randn(B, H, n * blk, D)
    rank = _rank_earlier_blocks(q.view(B * H, n, blk, D).mean(2), k.view(B * H, n, blk, D).mean(2))
    kept = [1, 2, 2, 3, 3]
    expected = []
    for bh in range(B * H):
        qs, ks = q.reshape(B * H, -1, D)[bh], k.reshape(B * H, -1, D)[bh]
        for i in range(n):
            row = i * blk + blk - 1
            p = (qs[row] @ ks[: row + 1].T / D**0.5).softmax(-1)
            blocks = {i, *rank[bh, i, : kept[i] - 1].tolist()}
            expected.append(sum(float(p[j * blk : (j + 1) * blk].sum()) for j in blocks))
    assert float(_coverage(q, k, rank, kept, blk)) == pytest.approx(sum(expected) / len(expected), rel=1e-5)
