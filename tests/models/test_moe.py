"""MoEMLP: exactness against MLP, routing/capacity rules, auxiliary loss, statistics, errors."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from dynmo_lightning.models.gpt import MLP
from dynmo_lightning.models.moe import MoEMLP
from dynmo_lightning.protocol import probing

C, HIDDEN = 16, 32


def _moe(n_experts: int, seed: int = 0, **kwargs) -> MoEMLP:
    torch.manual_seed(seed)
    moe = MoEMLP(C, HIDDEN, n_experts, **kwargs)
    with torch.no_grad():
        # A sharper router than the default init, so routing is uneven and capacity matters.
        moe.router.weight.normal_(0.0, 1.0)
    return moe


def _reference(moe: MoEMLP, x: torch.Tensor) -> torch.Tensor:
    """Dropless routing token by token: sum over the chosen experts of weight * expert(token)."""
    probs = moe.router(x).float().softmax(-1)
    top_p, top_e = probs.topk(moe.top_k, -1)
    weights = top_p if moe.top_k == 1 else top_p / top_p.sum(-1, keepdim=True)
    rows = []
    for t in range(x.shape[0]):
        rows.append(sum(w * moe.experts[int(e)](x[t : t + 1])[0] for w, e in zip(weights[t], top_e[t], strict=True)))
    return torch.stack(rows)


def test_single_expert_reproduces_mlp_bit_for_bit():
    torch.manual_seed(0)
    mlp = MLP(C, HIDDEN, 0.0, True)
    moe = MoEMLP(C, HIDDEN, 1, top_k=1, capacity_factor=None)
    moe.experts[0].load_state_dict(mlp.state_dict())
    x = torch.randn(3, 10, C)
    y, _ = moe(x)
    assert y.shape == x.shape
    assert torch.equal(y, mlp(x))
    flat, _ = moe(x[0])
    assert torch.equal(flat, mlp(x[0]))


def test_expert_weights_look_like_mlp_weights():
    keys = set(MoEMLP(C, HIDDEN, 3).state_dict())
    mlp_keys = set(MLP(C, HIDDEN, 0.0, True).state_dict())
    assert keys == {"router.weight"} | {f"experts.{e}.{k}" for e in range(3) for k in mlp_keys}


@pytest.mark.parametrize("top_k", [1, 2])
def test_dropless_routing_matches_token_by_token_reference(top_k):
    moe = _moe(4, top_k=top_k, capacity_factor=None)
    x = torch.randn(40, C)
    y, _ = moe(x)
    torch.testing.assert_close(y, _reference(moe, x), rtol=1e-5, atol=1e-6)
    assert moe.drop_fraction == 0.0
    assert sum(moe.tokens_per_expert) == 40 * top_k


def test_top2_weights_are_renormalised():
    # Two identical experts: renormalised top-2 weights sum to 1, so the mixture equals one expert.
    moe = _moe(2, top_k=2, capacity_factor=None)
    moe.experts[1].load_state_dict(moe.experts[0].state_dict())
    x = torch.randn(25, C)
    y, _ = moe(x)
    torch.testing.assert_close(y, moe.experts[0](x), rtol=1e-5, atol=1e-6)


def test_capacity_drops_lowest_probability_assignments():
    moe = _moe(4, top_k=1, capacity_factor=0.5)
    n = 64
    x = torch.randn(n, C)
    probs = moe.router(x).softmax(-1)
    top_p, top_e = probs.max(-1)
    cap = math.ceil(0.5 * n / 4)
    routed = torch.bincount(top_e, minlength=4)
    assert routed.max() > cap, "the test needs an expert over capacity"

    y, _ = moe(x)
    expected_kept = routed.clamp(max=cap)
    assert moe.tokens_per_expert == expected_kept.tolist()
    assert moe.drop_fraction == pytest.approx(1 - expected_kept.sum().item() / n)
    # Kept tokens of an expert are its highest-probability ones; dropped tokens get nothing (the residual carries them).
    for e in range(4):
        tokens = (top_e == e).nonzero().flatten()
        keep = tokens[top_p[tokens].argsort(descending=True, stable=True)[:cap]]
        dropped = tokens[~torch.isin(tokens, keep)]
        assert torch.all(y[dropped] == 0)
        torch.testing.assert_close(y[keep], top_p[keep, None] * moe.experts[e](x[keep]), rtol=1e-5, atol=1e-6)


class _GroupedFlops(TorchDispatchMode):
    """Multiply-add flops of grouped GEMMs: only the rows up to the last offset are computed."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default:
            a, b, offs = args[0], args[1], kwargs.get("offs", args[2] if len(args) > 2 else None)
            self.flops += 2 * int(offs[-1]) * a.shape[-1] * b.shape[-1]
        return func(*args, **kwargs)


def _linear_flops(moe: MoEMLP, x: torch.Tensor) -> int:
    with FlopCounterMode(display=False) as counter, _GroupedFlops() as grouped:
        moe(x)
    return counter.get_total_flops() + grouped.flops


@pytest.mark.parametrize("grouped", [None, False])
def test_expert_flops_follow_routing(grouped):
    n = 64
    x = torch.randn(n, C)
    dense = _moe(4, capacity_factor=None)
    capped = _moe(4, capacity_factor=0.5)
    dense.grouped = capped.grouped = grouped
    router_flops = 2 * n * C * 4
    per_token = 2 * (2 * C * HIDDEN)  # fc and proj, one multiply-add each
    dense_flops, capped_flops = _linear_flops(dense, x), _linear_flops(capped, x)
    assert dense_flops == router_flops + per_token * n
    assert capped_flops == router_flops + per_token * sum(capped.tokens_per_expert)
    assert capped_flops < dense_flops
    assert capped.drop_fraction == pytest.approx(1 - sum(capped.tokens_per_expert) / n)


def test_aux_loss_value_and_gradient_reach_router():
    moe = _moe(4, top_k=2, capacity_factor=1.0, aux_loss_coef=0.01, z_loss_coef=1e-3)
    x = torch.randn(2, 16, C)
    _, aux = moe(x)
    logits = moe.router(x.reshape(-1, C))
    probs = logits.softmax(-1)
    chosen = probs.topk(2, -1).indices.flatten()
    fraction = torch.bincount(chosen, minlength=4).float() / chosen.numel()
    expected = 0.01 * 4 * (fraction * probs.mean(0)).sum() + 1e-3 * torch.logsumexp(logits, -1).square().mean()
    torch.testing.assert_close(aux, expected)
    assert aux.dim() == 0
    aux.backward()
    assert moe.router.weight.grad is not None and moe.router.weight.grad.abs().sum() > 0


def test_output_gradient_reaches_router_and_experts():
    moe = _moe(4, top_k=1, capacity_factor=None)
    y, _ = moe(torch.randn(32, C))
    y.square().sum().backward()
    assert moe.router.weight.grad.abs().sum() > 0
    assert any(e.fc.weight.grad is not None for e in moe.experts)


def test_routing_is_deterministic_and_ties_go_to_earlier_tokens():
    moe = _moe(4, top_k=2, capacity_factor=0.75)
    x = torch.randn(48, C)
    y1, aux1 = moe(x)
    stats1 = (moe.tokens_per_expert, moe.drop_fraction)
    y2, aux2 = moe(x)
    assert torch.equal(y1, y2) and torch.equal(aux1, aux2)
    assert (moe.tokens_per_expert, moe.drop_fraction) == stats1

    # A zero router gives every token the same probabilities: capacity keeps the earliest tokens.
    tied = _moe(2, top_k=1, capacity_factor=1.0)
    with torch.no_grad():
        tied.router.weight.zero_()
    x = torch.randn(10, C)
    y, _ = tied(x)
    cap = math.ceil(10 / 2)
    assert tied.tokens_per_expert in ([cap, 0], [0, cap])
    assert torch.all(y[cap:] == 0) and torch.all(y[:cap].abs().sum(-1) > 0)


def test_statistics_skip_probing_and_travel_with_pickle():
    moe = _moe(4, capacity_factor=0.5)
    moe(torch.randn(64, C))
    stats = (list(moe.tokens_per_expert), moe.drop_fraction)
    with probing():
        moe(torch.randn(8, C))
    assert (moe.tokens_per_expert, moe.drop_fraction) == stats
    clone = pickle.loads(pickle.dumps(moe))
    assert (clone.tokens_per_expert, clone.drop_fraction) == stats


def test_empty_token_list():
    moe = _moe(3)
    y, aux = moe(torch.randn(0, C))
    assert y.shape == (0, C) and aux.item() == 0.0
    aux.backward()
    assert moe.tokens_per_expert == [0, 0, 0] and moe.drop_fraction == 0.0


def test_training_step_with_aux_loss():
    moe = _moe(4, top_k=2)
    opt = torch.optim.SGD(moe.parameters(), lr=0.1)
    x, target = torch.randn(32, C), torch.randn(32, C)
    y, aux = moe(x)
    (F.mse_loss(x + y, target) + aux).backward()
    opt.step()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_experts": 2, "top_k": 3}, r"model\.moe_top_k=3 > model\.n_experts=2"),
        ({"n_experts": 2, "top_k": 0}, r"model\.moe_top_k=0"),
        ({"n_experts": 0, "top_k": 1}, r"model\.n_experts=0"),
        ({"n_experts": 2, "capacity_factor": 0.0}, r"model\.moe_capacity_factor=0\.0"),
        ({"n_experts": 2, "capacity_factor": -1.0}, r"model\.moe_capacity_factor=-1\.0"),
    ],
)
def test_invalid_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoEMLP(C, HIDDEN, **kwargs)


@pytest.mark.parametrize(("top_k", "capacity"), [(1, None), (1, 0.5), (2, 0.75)])
def test_grouped_experts_equal_the_per_expert_loop(top_k, capacity):
    grouped, loop = _moe(4, top_k=top_k, capacity_factor=capacity), _moe(4, top_k=top_k, capacity_factor=capacity)
    loop.grouped = False
    assert grouped.masks_on_device(torch.randn(1, C)) and not loop.masks_on_device(torch.randn(1, C))
    x = torch.randn(2, 24, C)
    (y1, a1), (y2, a2) = grouped(x), loop(x)
    torch.testing.assert_close(y1, y2, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(a1, a2, rtol=1e-6, atol=1e-7)
    assert grouped.tokens_per_expert == loop.tokens_per_expert
    assert grouped.drop_fraction == pytest.approx(loop.drop_fraction)
    (y1.square().sum() + a1).backward()
    (y2.square().sum() + a2).backward()
    for p, q in zip(grouped.parameters(), loop.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None) or (q.grad is None and not p.grad.any())
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(("top_k", "capacity"), [(1, 0.5), (2, 1.0)])
def test_a_mask_of_real_tokens_equals_routing_those_tokens_alone(top_k, capacity):
    moe = _moe(4, top_k=top_k, capacity_factor=capacity)
    x = torch.randn(3, 10, C)
    valid = torch.rand(3, 10) < 0.6
    y, aux = moe(x, valid)
    stats = (moe.tokens_per_expert, moe.drop_fraction)
    y_alone, aux_alone = moe(x[valid])
    torch.testing.assert_close(y[valid], y_alone, rtol=1e-6, atol=1e-7)
    assert torch.all(y[~valid] == 0)
    torch.testing.assert_close(aux, aux_alone, rtol=1e-6, atol=1e-7)
    assert stats == (moe.tokens_per_expert, pytest.approx(moe.drop_fraction))


@pytest.mark.parametrize("masked", [False, True])
def test_grouped_experts_read_nothing_from_the_device(monkeypatch, masked):
    from dynmo_lightning.callbacks.syncs import SYNC_METHODS, counting_dispatch

    def refuse(*args, **kwargs):
        raise AssertionError("a host read inside the grouped MoE layer")

    moe = _moe(4, top_k=2, capacity_factor=0.75)
    x, valid = torch.randn(2, 12, C), torch.rand(2, 12) < 0.7
    with monkeypatch.context() as patch:
        for name in SYNC_METHODS:
            patch.setattr(torch.Tensor, name, refuse)
        with counting_dispatch() as seen:
            y, aux = moe(x, valid if masked else None)
            (y.square().sum() + aux).backward()
    assert not seen, seen


def test_a_mask_needs_grouped_experts():
    moe = _moe(2)
    moe.grouped = False
    with pytest.raises(ValueError, match="mask of real tokens only where its experts run grouped"):
        moe(torch.randn(4, C), torch.ones(4, dtype=torch.bool))
