"""Layer initialisation: layer ``i`` gets the same weights on any stage and any device, from the CPU generator."""

from __future__ import annotations

import torch
from torch import nn

from dynmo_lightning.models import GPT
from dynmo_lightning.protocol import init_layer, materialise_layer


class Recorder:
    """A module whose ``pipeline_init_layer`` records where the layer's parameters are while it initialises them."""

    def __init__(self) -> None:
        self.devices: list[torch.device] = []

    def pipeline_init_layer(self, index: int, layer: nn.Module) -> None:
        for p in layer.parameters():
            self.devices.append(p.device)
            nn.init.normal_(p)


def _meta_linear() -> nn.Linear:
    with torch.device("meta"):
        return nn.Linear(8, 8)


def test_a_layer_bound_for_another_device_is_initialised_on_the_host():
    # "meta" stands in for an accelerator here: the layer ends there, but its values were drawn on the CPU.
    module, layer = Recorder(), _meta_linear()
    materialise_layer(module, 3, layer, 7, torch.device("meta"))
    assert module.devices == [torch.device("cpu")] * 2
    assert layer.weight.device.type == "meta"


def test_the_same_layer_gets_the_same_weights_wherever_it_is_built():
    a, b = _meta_linear(), _meta_linear()
    materialise_layer(Recorder(), 3, a, 7, torch.device("cpu"))
    torch.manual_seed(123)  # the global generator's state does not matter ...
    materialise_layer(Recorder(), 3, b, 7, torch.device("cpu"))
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    state = torch.random.get_rng_state()
    c = _meta_linear()
    materialise_layer(Recorder(), 4, c, 7, torch.device("cpu"))  # ... and is left as it was; other layers differ
    assert torch.equal(state, torch.random.get_rng_state()) and not torch.equal(a.weight, c.weight)


def test_a_gpt_built_whole_equals_its_layers_materialised_one_by_one():
    whole = GPT(n_layer=2, n_embd=16, n_head=2, block_size=8, vocab_size=32, tie_embeddings=False)
    whole.configure_model()
    with torch.device("meta"):
        split = GPT(n_layer=2, n_embd=16, n_head=2, block_size=8, vocab_size=32, tie_embeddings=False)
        split.configure_model()
    for i, layer in reversed(list(enumerate(split.pipeline_layers()))):  # any order
        materialise_layer(split, i, layer, split.pipeline_init_seed, torch.device("cpu"))
    for (name, p), q in zip(whole.state_dict().items(), split.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


def test_init_layer_keeps_the_parameters_objects():
    layer = nn.Linear(4, 4)
    weight = layer.weight
    init_layer(Recorder(), 0, layer, 0)
    assert layer.weight is weight
