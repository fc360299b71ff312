"""MoEMLP's memory at GPU sizes, measured on the CPU: grouped expert weights are read as one block, never stacked.

Each expert's weights of one matrix are slices of one block of memory, so the grouped GEMM reads them as one
``(E, out, in)`` tensor: no stacked copy per call, and under autocast one cast per training step shared by every
micro-batch (as autocast caches a linear layer's cast weight), not one per call. On CUDA the experts' token groups
are padded to 16-byte multiples of rows (8 in bf16) for the grouped GEMM kernel.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode

from dynmo_lightning.models import moe as moe_module
from dynmo_lightning.models import moe_storage
from dynmo_lightning.models.moe import MoEMLP, group_alignment

pytestmark = pytest.mark.timeout(120)

C, HIDDEN, E = 128, 512, 8
BLOCK = E * C * HIDDEN  # elements of one matrix of all experts


def _moe(**kwargs) -> MoEMLP:
    torch.manual_seed(0)
    return MoEMLP(C, HIDDEN, E, top_k=2, capacity_factor=None, **kwargs)


class _BlockCopies(TorchDispatchMode):
    """Bytes of new tensors the size of one matrix of all experts (stacks and casts of the expert weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.copies: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs or {}))
            if isinstance(t, torch.Tensor)
        }  # fmt: skip
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() == BLOCK and t.untyped_storage().data_ptr() not in inputs:
                self.bytes += t.nbytes
                self.copies.append(f"{func} {t.dtype}")
        return out


def _matrices(moe: MoEMLP) -> list[list[torch.Tensor]]:
    names = [(lin, name) for lin in ("fc", "proj") for name in ("weight", "bias")]
    return [[getattr(getattr(e, lin), name) for e in moe.experts] for lin, name in names]


def _in_blocks(moe: MoEMLP) -> bool:
    return all(moe_storage._block(params) is not None for params in _matrices(moe))


def test_forward_and_backward_in_float32_copy_no_expert_weights():
    moe, x = _moe(), torch.randn(64, C)
    with _BlockCopies() as forward:
        y, aux = moe(x)
    with _BlockCopies() as backward:
        (y.square().sum() + aux).backward()
    # Before: every call stacked both matrices of all experts (2 x 2 MiB here, 2 GiB per GEMM at hidden 4096 and 8
    # experts), and autograd kept the stacks for backward.
    assert forward.bytes == 0, forward.copies
    # Backward makes each matrix's gradient once (the experts' gradients are its slices): no copy of the weights.
    assert backward.bytes == 2 * BLOCK * 4, backward.copies
    assert moe.experts[3].fc.weight.grad is not None and moe.experts[3].fc.weight.grad.abs().sum() > 0


def test_activations_of_a_forward_hold_no_expert_weights():
    moe, x = _moe(), torch.randn(64, C)
    tracker = MemTracker()
    tracker.track_external(moe)
    with tracker:
        outputs = moe(x)  # held: what their graph saves for backward stays
    peak, held = (_activations(tracker.get_tracker_snapshot(when)) for when in ("peak", "current"))
    # Before: peak 3.2 MB and 2.9 MB held for backward (the stacked proj weights, 2.1 MB); now 1.1 and 0.8 MB.
    assert peak < BLOCK * 4 and held < BLOCK * 4, (peak, held)
    del outputs


def _activations(snapshot: dict) -> int:
    return next(v for k, v in snapshot[torch.device("cpu")].items() if str(k).endswith("ACT"))


def test_micro_batches_of_a_step_share_one_cast_of_the_experts_under_autocast():
    moe = _moe()
    xs = [torch.randn(32, C, requires_grad=True) for _ in range(3)]  # a later stage's inputs
    with _BlockCopies() as copies, torch.autocast("cpu", dtype=torch.bfloat16):
        outs = [moe(x) for x in xs]  # three micro-batches in flight
    # Before: per call, both matrices stacked in fp32 and cast to bf16 (3 x 2 x (4 + 2) bytes per element); now one
    # bf16 cast of each block for all three, which their graphs share until backward.
    assert copies.bytes == 2 * BLOCK * 2, copies.copies
    sum(y.float().square().sum() + aux for y, aux in outs).backward()

    reference = _moe()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = [reference(x) for x in xs]
    sum(y.float().square().sum() + aux for y, aux in expected).backward()
    for p, q in zip(moe.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)

    with torch.no_grad():
        moe.experts[0].fc.weight.add_(1.0)  # an optimizer step: the parameters changed, the cast is made again
    with _BlockCopies() as again, torch.autocast("cpu", dtype=torch.bfloat16):
        moe(xs[0])
    assert again.bytes == 2 * BLOCK * 2


def test_the_experts_stay_in_blocks_when_moved_copied_pickled_or_loaded():
    moe = _moe()
    assert _in_blocks(moe)
    state = {k: v.clone() for k, v in moe.state_dict().items()}
    assert _in_blocks(moe.to(torch.float64)) and moe.experts[0].fc.weight.dtype == torch.float64
    moe.float()
    assert _in_blocks(copy.deepcopy(moe))
    assert _in_blocks(pickle.loads(pickle.dumps(moe)))
    fresh = MoEMLP(C, HIDDEN, E, top_k=2, capacity_factor=None).to_empty(device="cpu")
    assert _in_blocks(fresh)
    fresh.load_state_dict(state)
    assert _in_blocks(fresh) and set(fresh.state_dict()) == set(state)
    x = torch.randn(16, C)
    torch.testing.assert_close(fresh(x)[0], moe(x)[0])


def test_group_alignment_is_16_bytes_of_rows_on_cuda_only():
    assert group_alignment(torch.device("cuda", 0), torch.bfloat16) == 8
    assert group_alignment(torch.device("cuda", 0), torch.float32) == 4
    assert group_alignment(torch.device("cpu"), torch.bfloat16) == 1


@pytest.mark.parametrize(("top_k", "capacity", "masked"), [(1, None, False), (2, 0.75, False), (2, 1.0, True)])
def test_padded_token_groups_start_at_multiples_of_8_rows_and_change_nothing(monkeypatch, top_k, capacity, masked):
    torch.manual_seed(1)
    x, valid = torch.randn(3, 13, C), torch.rand(3, 13) < 0.7
    results = []
    for align in (1, 8):
        torch.manual_seed(0)
        moe = MoEMLP(C, HIDDEN, E, top_k=top_k, capacity_factor=capacity)
        offsets: list[torch.Tensor] = []
        grouped_mm = torch.nn.functional.grouped_mm

        def recording(a, b, *, offs, _record=offsets, _mm=grouped_mm, **kwargs):
            _record.append(offs.clone())
            return _mm(a, b, offs=offs, **kwargs)

        monkeypatch.setattr(moe_module, "group_alignment", lambda device, dtype, _align=align: _align)
        monkeypatch.setattr(moe_module.F, "grouped_mm", recording)
        y, aux = moe(x, valid if masked else None)
        (y.square().sum() + aux).backward()
        monkeypatch.undo()
        assert len(offsets) == 2 and all(bool((o % align == 0).all()) for o in offsets)
        results.append((y, aux, [p.grad for p in moe.parameters()], moe.tokens_per_expert, offsets[0]))
    (y1, a1, g1, t1, o1), (y8, a8, g8, t8, o8) = results
    assert t1 == t8 and bool((o8 >= o1).all()) and int(o8[-1]) > int(o1[-1])  # padding rows were added
    torch.testing.assert_close(y8, y1, rtol=1e-4, atol=1e-5)  # GEMMs of other row counts block differently
    torch.testing.assert_close(a8, a1)
    for p, q in zip(g8, g1, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
