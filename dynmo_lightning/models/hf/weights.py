"""Where Hugging Face pipeline layers get their weights: nowhere until their stage gives them some.

``from_hf`` builds the Hugging Face model inside :func:`meta_parameters`: its parameters are on the meta device, so no
process allocates the whole model. Whoever materialises a layer (a pipeline strategy each stage's own layers,
``HFCausalLM.configure_model`` all of them on one device) gives it

* from a config, Hugging Face's own initialisation of that layer alone (:func:`init_like_hf`: the model's
  ``_init_weights``, the rules ``from_config`` applies), drawn from the CPU generator seeded for the layer, so layer
  ``i`` has the same weights on any stage and device;
* from a checkpoint, its own tensors read by key from the safetensors files (:class:`SafetensorsWeights`); nothing
  else of the checkpoint is read, and nothing in it can run code.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

#: The safetensors files ``save_pretrained`` writes: one file, or shards listed in an index.
SAFE_WEIGHTS, SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Modules built inside put their parameters on the meta device, their buffers on the host (Accelerate's way).

    Buffers (rotary frequencies; GPT-2's causal masks in transformers 4) are small and computed from the config, so
    they are built for real. A parameter is replaced as it registers, before anything writes it: the empty host
    tensor it was made from is freed untouched.
    """

    def to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        if param is None or param.is_meta:
            return None  # tying registers the same (meta) parameter again: keep it the same object
        return type(param)(param.to("meta"), requires_grad=param.requires_grad)

    handle = nn.modules.module.register_module_parameter_registration_hook(to_meta)
    try:
        yield
    finally:
        handle.remove()


def init_rules(model: nn.Module) -> nn.Module:
    """The Hugging Face model without its modules: what its ``_init_weights`` reads (the config), none of its weights.

    Layers dropped by the pipeline split or moved away by migration must not stay referenced by a whole model kept
    for its initialisation rules.
    """
    shell = copy.copy(model)
    shell._modules, shell._parameters, shell._buffers = {}, {}, {}
    return shell


def init_like_hf(rules: nn.Module, modules: Iterable[nn.Module]) -> None:
    """Hugging Face's initialisation of ``modules`` (whole Hugging Face submodules) from the current CPU generator.

    ``rules._init_weights`` runs on every submodule, children first, as ``from_config`` applies it. A parameter the
    rules leave alone keeps its constructor value in Hugging Face (transformers 4 has no rule for RMSNorm, built as
    ones): norms get ones and zeros, as transformers 5's rules give them; any other is an error, never garbage.

    Raises:
        ValueError: a parameter no rule initialises.
    """
    with torch.no_grad():
        for module in modules:
            for p in module.parameters():
                p.fill_(float("nan"))  # marks what no rule reached
            for sub in _children_first(module):
                rules._init_weights(sub)
            for sub in module.modules():
                for name, p in sub.named_parameters(recurse=False):
                    if not p.isnan().any():
                        continue
                    if "Norm" not in type(sub).__name__ or name not in ("weight", "bias"):
                        raise ValueError(
                            f"{type(rules).__name__}._init_weights does not initialise {type(sub).__name__}.{name}: "
                            "build the model on the host (from_hf(AutoModelForCausalLM.from_config(config)))"
                        )
                    p.fill_(1.0 if name == "weight" else 0.0)


def _children_first(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from _children_first(child)
    yield module


class SafetensorsWeights:
    """The tensors of a local Hugging Face checkpoint directory, read by key: a layer reads its own and no others.

    ``model.safetensors``, or shards listed in ``model.safetensors.index.json``. Only safetensors: a
    ``pytorch_model.bin`` is a pickle, which can run code when it is loaded.

    Args:
        directory: the checkpoint directory (``save_pretrained``'s output).
        base_prefix: the causal LM's ``base_model_prefix`` (``"model"``, ``"transformer"``): checkpoints of the base
            model store keys without it.

    Raises:
        ValueError: the directory holds no safetensors weights.
    """

    def __init__(self, directory: str | os.PathLike[str], base_prefix: str) -> None:
        d = Path(directory)
        self.base_prefix = base_prefix
        if (d / SAFE_INDEX).is_file():
            weight_map = json.loads((d / SAFE_INDEX).read_text())["weight_map"]
            self.files = {key: d / name for key, name in weight_map.items()}
        elif (d / SAFE_WEIGHTS).is_file():
            from safetensors import safe_open

            with safe_open(d / SAFE_WEIGHTS, framework="pt") as f:  # reads the header only
                self.files = dict.fromkeys(f.keys(), d / SAFE_WEIGHTS)
        else:
            pickled = sorted(p.name for p in d.glob("pytorch_model*.bin"))
            found = f" but only {pickled}, pickles that can run code when they are loaded" if pickled else ""
            raise ValueError(
                f"{d} has no safetensors weights ({SAFE_WEIGHTS} or {SAFE_INDEX}){found}. from_hf loads safetensors "
                f"only: write the checkpoint again with save_pretrained (safetensors by default) where you trust it"
            )

    def stored_key(self, key: str) -> str | None:
        """The checkpoint's name of the Hugging Face key ``key`` (``None``: not in the checkpoint)."""
        if key in self.files:
            return key
        bare = key.removeprefix(self.base_prefix + ".")
        return bare if bare in self.files else None

    def read(self, keys: Iterable[str]) -> dict[str, Tensor]:
        """The tensors of ``keys`` (Hugging Face names), each file opened once, only those tensors read.

        Raises:
            KeyError: a key the checkpoint does not hold.
        """
        from safetensors import safe_open

        by_file: dict[Path, list[tuple[str, str]]] = {}
        for key in keys:
            stored = self.stored_key(key)
            if stored is None:
                raise KeyError(f"{key!r} is not in the checkpoint {next(iter(self.files.values())).parent}")
            by_file.setdefault(self.files[stored], []).append((key, stored))
        out = {}
        for file, names in by_file.items():
            with safe_open(file, framework="pt", device="cpu") as f:
                out.update((key, f.get_tensor(stored)) for key, stored in names)
        return out
