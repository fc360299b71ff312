"""``strategy.compile`` options that turn on CUDA graphs are refused when the strategy is made (before any worker).

A CUDA graph replays fixed memory: a pipeline schedule keeps several micro-batches' outputs alive across replays and
FSDP2 frees and re-allocates its parameters' storage. ``torch.compile`` captures graphs under the modes
``"reduce-overhead"`` and ``"max-autotune"``, inductor's ``triton.cudagraphs`` option, the ``"cudagraphs"`` backend
and inductor's process-wide ``TORCHINDUCTOR_CUDAGRAPHS=1``.
"""

from __future__ import annotations

import pytest

from dynmo_lightning import DynMoStrategy
from dynmo_lightning.pipeline.parallel.compiled import check_options


@pytest.mark.parametrize(
    ("options", "setting", "fix"),
    [
        ({"mode": "reduce-overhead"}, "mode='reduce-overhead'", "use mode 'default'"),
        ({"mode": "max-autotune"}, "mode='max-autotune'", "use mode 'max-autotune-no-cudagraphs'"),
        ({"options": {"triton.cudagraphs": True}}, r"options=\{'triton.cudagraphs': True\}", "leave that option out"),
        ({"backend": "cudagraphs"}, "backend='cudagraphs'", "use the default backend"),
    ],
)
def test_options_that_capture_cuda_graphs_are_refused_when_the_strategy_is_made(options, setting, fix):
    with pytest.raises(ValueError, match=rf"^strategy.compile {setting} turns on CUDA graphs, .*: {fix}"):
        DynMoStrategy(compile=options)


def test_the_modes_refused_are_torchs_modes_with_cuda_graphs():
    from torch._inductor import list_mode_options

    with_graphs = {mode for mode, opts in list_mode_options().items() if opts.get("triton.cudagraphs")}
    assert with_graphs == {"reduce-overhead", "max-autotune"}
    for mode in set(list_mode_options()) - with_graphs:
        assert check_options({"mode": mode}) == {"mode": mode}


def test_inductors_process_wide_switch_is_refused_unless_an_option_turns_it_off(monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CUDAGRAPHS", "1")
    with pytest.raises(ValueError, match="under TORCHINDUCTOR_CUDAGRAPHS=1 turns on CUDA graphs"):
        check_options(True)
    off = {"options": {"triton.cudagraphs": False}}
    assert check_options(off) == off
    assert check_options({"backend": "aot_eager"}) == {"backend": "aot_eager"}  # not inductor: no graphs
    assert check_options(False) is None


def test_options_without_cuda_graphs_pass():
    for options in ({}, {"mode": "max-autotune-no-cudagraphs"}, {"options": {"max_autotune": True}}):
        assert check_options(options) == options
    assert DynMoStrategy(compile={"mode": "default"}).settings.compile == {"mode": "default"}
