"""What no tensor-parallel plan splits (embedding, norms, experts) is held by every process of the stage; its copies'
gradients are averaged over the tensor-parallel group once per step, so nondeterministic kernels cannot let them drift.

Two gloo processes of one stage (``tests/support/_tp_grads_script.py``), plain and under FSDP2 over a replica mesh
of one, with gradients made different on the two: every replicated gradient becomes their mean on both (a peer
without one counts as a zero, a parameter none has a gradient for keeps none), the split layer's gradient is left
alone, and a step where every gradient is present reads nothing on the host.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from support import SUPPORT
from support.helpers import launch_script

SPLIT = ("1.0.weight", "1.0.bias")
REPLICATED = ("0.weight", "2.weight", "2.bias", "3.first.weight", "3.first.bias")
ONE_PEER = ("3.second.weight", "3.second.bias")  # only rank 0 has a gradient


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp_grads")
    launch_script(2, SUPPORT / "_tp_grads_script.py", str(d / "out"), log_dir=d / "logs", timeout=240)
    return [json.loads((d / f"out.rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["plain", "fsdp"])
def test_replicated_gradients_become_their_mean_over_the_group(ranks, case):
    zero, one = ranks[0][case], ranks[1][case]
    for name in REPLICATED:
        mean = (np.array(zero["before"][name]) + np.array(one["before"][name])) / 2
        assert zero["after"][name] == one["after"][name], name  # the copies are equal, bit for bit
        np.testing.assert_allclose(zero["after"][name], mean, rtol=1e-6, err_msg=name)
        assert one["peer_before"][name] == zero["before"][name]
    for name in ONE_PEER:
        assert one["before"][name] is None and zero["after"][name] == one["after"][name], name
        np.testing.assert_allclose(zero["after"][name], np.array(zero["before"][name]) / 2, rtol=1e-6, err_msg=name)
    assert zero["after"]["3.never"] is None and one["after"]["3.never"] is None  # no peer used it


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["plain", "fsdp"])
def test_split_gradients_are_left_alone_and_nothing_is_read_on_the_host(ranks, case):
    for rank in ranks:
        for name in SPLIT:
            assert rank[case]["after"][name] == rank[case]["before"][name], name
        assert rank[case]["reads"] == {}
    assert ranks[0][case]["before"]["1.0.weight"] != ranks[1][case]["before"]["1.0.weight"]  # each its own part
