"""``from_hf``: a Hugging Face causal LM (or its config) as a pipeline-ready LightningModule, and back.

The module's layers are the Hugging Face model's own modules, regrouped into pipeline layers (:mod:`.layers`):
embedding, every decoder layer, final norm + head. Tied embeddings stay one shared parameter, which the pipeline
keeps exact across stages (:mod:`dynmo_lightning.pipeline.stage.ties`). The loss is Hugging Face's causal-LM
cross-entropy (logits upcast to float, ``-100`` ignored); dataloader batches are ``(input_ids, next_token_ids)`` pairs,
or Hugging Face style dicts ``{"input_ids", "labels"}`` whose labels are shifted as Hugging Face does.

From a config or a checkpoint, the layers start on the meta device (:mod:`.weights`): under a pipeline strategy each
stage materialises only its own layers (initialised, or read from the checkpoint by key), so no process holds the
whole model; :meth:`HFCausalLM.configure_model` materialises all of them everywhere else.
:func:`save_hf` writes a trained module's weights back as a Hugging Face checkpoint (``save_pretrained``).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dynmo_lightning.core.layer_init import layer_seed, materialise_layer
from dynmo_lightning.core.model import PipelineModule
from dynmo_lightning.models.hf.layers import FAMILIES, MODEL_TYPES, DecoderLayer, Embedding, Family, Head
from dynmo_lightning.models.hf.weights import SafetensorsWeights, init_like_hf, init_rules, meta_parameters
from dynmo_lightning.models.routing import DepthRouter, ExitGate

IGNORE_INDEX = -100

#: Options of :meth:`HFCausalLM.configure_dynamics` (what the early-exit and Mixture-of-Depths callbacks switch on).
DYNAMIC_OPTIONS = {"early_exit", "mod_every", "mod_capacity"}


def transformers() -> Any:
    """The ``transformers`` package, or a clear error saying how to install it."""
    try:
        import transformers as tf
    except ImportError as err:
        raise ImportError(
            "Hugging Face models need the `transformers` package: pip install 'dynmo-lightning[hf]'"
        ) from err
    return tf


class HFCausalLM(PipelineModule):
    """A Hugging Face causal LM split into pipeline layers (build it with :func:`from_hf`).

    Layers whose parameters are on the meta device get their weights where they run (:meth:`configure_model`, or a
    pipeline strategy's split through :meth:`pipeline_init_layer`).

    Args:
        model: a ``transformers`` causal LM of a supported family (GPT-2; Llama, Mistral, Qwen2), its parameters
            real or on the meta device (:func:`~dynmo_lightning.models.hf.weights.meta_parameters`).
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay of weight matrices (biases, norms and embeddings are not decayed).
        betas: AdamW betas.
        eps: AdamW epsilon.
        optimizer: ``param_groups -> Optimizer`` instead of AdamW (it receives the two groups, decayed first).
        lr_scheduler: ``optimizer -> LR scheduler`` stepped every optimizer step (``None``: none).
        seed: base seed of the per-layer initialisation of meta-device layers and of the dynamic parts added later
            (routers): the same weights on every process.
        weights: where meta-device layers read their tensors (``from_hf(pretrained=...)``); ``None``: they are
            initialised by the Hugging Face model's rules.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float = 3e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer] | None = None,
        lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
        seed: int = 0,
        weights: SafetensorsWeights | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["model", "optimizer", "lr_scheduler", "weights"])
        self.family = _family(model.config)
        self.hparams["hf_config"] = model.config.to_dict()
        self._optimizer, self._lr_scheduler = optimizer, lr_scheduler
        self.embed, self.layers, self.head = _split(model, self.family)
        self.tied = self.head.lm_head.weight is self.embed.wte.weight
        self.pipeline_init_seed = seed
        self._weights = weights
        # Kept outside the module tree (a submodule would be trained and saved): the model's initialisation rules,
        # and every layer's buffers as built, which materialising a meta-device layer restores.
        self.__dict__["_init_rules"] = init_rules(model)
        self._built_buffers = {i: dict(layer.named_buffers()) for i, layer in enumerate(self.pipeline_layers())}

    # ----------------------------------------------------------------------------------------------------------------
    # Pipeline protocol
    # ----------------------------------------------------------------------------------------------------------------
    def configure_model(self) -> None:
        """Give the meta-device layers their weights on the default device (Lightning calls it in the Trainer's).

        Under ``DynMoStrategy`` the default device is the meta device and nothing happens: each stage materialises
        only its own layers when the strategy splits the model. Everywhere else (plain Lightning, or outside a
        Trainer: call it before using the module) every layer is materialised, each as a stage would.
        """
        device = torch.get_default_device()
        if device.type == "meta":
            return
        built = [(i, layer) for i, layer in enumerate(self.pipeline_layers()) if _is_meta(layer)]
        for i, layer in built:
            materialise_layer(self, i, layer, self.pipeline_init_seed, device)
        if built and self.tied:
            self.head.lm_head.weight = self.embed.wte.weight  # each materialised layer got its own copy: tie again

    def pipeline_init_layer(self, index: int, layer: nn.Module) -> None:
        """Initial weights of layer ``index``: its tensors from the checkpoint, else the Hugging Face model's rules.

        :func:`~dynmo_lightning.protocol.init_layer` calls it on the host, with the CPU generator seeded for this
        layer, after the layer got storage: the layer has the same weights wherever it is built. A tied output
        projection is left alone (the tie's value is the embedding's); buffers are restored as built, and dynamic
        parts (exit gates, depth routers) start as :meth:`configure_dynamics` builds them.
        """
        parts = _hf_parts(layer, self.tied)
        if self._weights is None:
            init_like_hf(self._init_rules, parts.values())
        else:
            self._load(_layer_prefix(index, layer), parts)
        with torch.no_grad():
            for name, value in self._built_buffers.get(index, {}).items():
                layer.get_buffer(name).copy_(value)
        if isinstance(layer, DecoderLayer):
            if layer.exit_gate is not None:
                layer.exit_gate.reset_buffers()
            router = layer.depth_router
            if router is not None:
                fresh = _depth_router(self.hparams.seed, index, router.router.in_features, router.initial_capacity)
                router.load_state_dict(fresh.state_dict())

    def _load(self, prefix: str, parts: Mapping[str, nn.Module]) -> None:
        """Copy the checkpoint's tensors of the Hugging Face ``parts`` of a layer (module names under ``prefix``)."""
        assert self._weights is not None
        state = {
            k: v
            for name, part in parts.items()
            for k, v in part.state_dict(prefix=f"{prefix}{name}.", keep_vars=True).items()
        }
        targets = to_hf_keys(state, self.family)[0]
        with torch.no_grad():
            for key, value in self._weights.read(targets).items():
                if value.shape != targets[key].shape:
                    raise ValueError(
                        f"{key} has shape {tuple(value.shape)} in the checkpoint but {tuple(targets[key].shape)} in "
                        "the model its config.json describes"
                    )
                targets[key].copy_(value)

    def forward(self, inputs: Any) -> Any:
        """All layers in order, once they have weights (:meth:`configure_model`; a Trainer calls it).

        Raises:
            RuntimeError: layers are still on the meta device.
        """
        if any(p.is_meta for p in self.parameters()):
            raise RuntimeError(
                "the layers of a from_hf module built from a config or checkpoint start on the meta device: call "
                "configure_model() before using the module outside a Trainer (a Trainer calls it)"
            )
        return super().forward(inputs)

    def pipeline_layers(self) -> list[nn.Module]:
        """Embedding, the decoder layers, and final norm + head, in order."""
        return [self.embed, *self.layers, self.head]

    def pipeline_split_batch(self, batch: Any) -> tuple[Tensor, Tensor]:
        """``(input_ids, next_token_ids)``; a dict's ``labels`` (default: its ``input_ids``) are shifted as HF does.

        Raises:
            ValueError: a dict batch whose ``attention_mask`` on the host has zeros (padding): pack sequences instead.
                A mask on a device is not read here (that would stall the device every batch): Lightning's loops
                check it on the host, in :meth:`on_before_batch_transfer`, before moving the batch.
        """
        if isinstance(batch, Mapping):
            ids = batch["input_ids"]
            _refuse_padding(batch.get("attention_mask"))
            return ids, shift_labels(batch.get("labels", ids))
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            return batch[0], batch[1]
        raise ValueError(f"a batch must be (input_ids, targets) or a dict with input_ids, got {type(batch).__name__}")

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Refuse padded dict batches while they are still on the host (Lightning moves them to the device next)."""
        if isinstance(batch, Mapping):
            _refuse_padding(batch.get("attention_mask"))
        return batch

    def pipeline_loss(self, output: Tensor | tuple[Tensor, Tensor], target: Tensor) -> Tensor:
        """Hugging Face's causal-LM cross-entropy on already shifted targets, plus carried auxiliary losses.

        The mean over the micro-batch's counted tokens: with ``-100`` targets spread unevenly over micro-batches, the
        mean of micro-batch means (what a pipeline step optimises) weighs tokens slightly differently from one mean
        over the whole batch.
        """
        logits, aux = output if isinstance(output, tuple) else (output, None)
        loss = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=IGNORE_INDEX
        )
        return loss if aux is None else loss + aux.sum()

    def configure_optimizers(self) -> Any:
        """AdamW (or the given optimizer) over two groups: weight matrices decayed, the rest not.

        Both groups always exist, so every pipeline stage has the same group layout; a tied output projection is in
        the embedding's (undecayed) group on whichever stage holds it.
        """
        hp = self.hparams
        embeddings = {"embed.wte.weight", "embed.wpe.weight"} | ({"head.lm_head.weight"} if self.tied else set())
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            (decay if p.dim() >= 2 and name not in embeddings else no_decay).append(p)
        groups = [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        if self._optimizer is not None:
            optimizer = self._optimizer(groups)
        else:
            optimizer = torch.optim.AdamW(groups, lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps)
        if self._lr_scheduler is None:
            return optimizer
        scheduler = self._lr_scheduler(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ----------------------------------------------------------------------------------------------------------------
    # Dynamics
    # ----------------------------------------------------------------------------------------------------------------
    def configure_dynamics(self, **options: Any) -> None:
        """Add exit gates (every decoder layer) or depth routers (every ``mod_every``-th) before training starts.

        Called by the ``TokenEarlyExit`` and ``MixtureOfDepths`` callbacks with ``early_exit``, ``mod_every`` and
        ``mod_capacity``; activations then carry ``(hidden, active, aux)`` between layers.

        Raises:
            ValueError: an option that cannot apply to Hugging Face layers (Mixture of Experts and sparse attention
                would replace their trained MLPs or attentions by other modules), both early exit and Mixture of
                Depths, or a bad value.
        """
        early_exit, mod_every, mod_capacity = _dynamic_options(options)
        self._check_one_dynamics(early_exit, mod_every)
        self._add_dynamic_parts(early_exit, mod_every, mod_capacity)
        self.embed.carry = any(layer.exit_gate is not None or layer.depth_router is not None for layer in self.layers)

    def _check_one_dynamics(self, early_exit: bool, mod_every: int) -> None:
        """Refuse early exit and Mixture of Depths together, asked for now or already on the layers.

        Args:
            early_exit: whether exit gates are asked for.
            mod_every: every how many layers a depth router is asked for (0: none).

        Raises:
            ValueError: both would act on the decoder layers.
        """
        has_gates = any(layer.exit_gate is not None for layer in self.layers)
        has_routers = any(layer.depth_router is not None for layer in self.layers)
        if (early_exit or has_gates) and (mod_every or has_routers):
            raise ValueError("early exit and Mixture of Depths cannot both act on the decoder layers of one model")

    def _add_dynamic_parts(self, early_exit: bool, mod_every: int, mod_capacity: float) -> None:
        """Give the decoder layers that lack one an exit gate (each layer) or a depth router (every ``mod_every``-th).

        Args:
            early_exit: whether to add exit gates.
            mod_every: every how many layers to add a depth router (0: none).
            mod_capacity: the depth routers' capacity.
        """
        hidden = self.hparams["hf_config"].get("hidden_size") or self.hparams["hf_config"]["n_embd"]
        for i, layer in enumerate(self.layers):
            device = next(layer.parameters()).device  # the meta device until the layer is materialised
            if early_exit and layer.exit_gate is None:
                layer.exit_gate = ExitGate().to(device)
            if mod_every and (i + 1) % mod_every == 0 and layer.depth_router is None:
                layer.depth_router = _depth_router(self.hparams.seed, i + 1, hidden, mod_capacity).to(device)

    def hf_state_dict(self) -> dict[str, Tensor]:
        """The weights under the Hugging Face model's names (dynamic parts, which it has no place for, left out)."""
        return to_hf_keys(self.state_dict(), self.family)[0]


def _family(config: Any) -> Family:
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"model_type={model_type!r} is not supported by from_hf; supported: {sorted(MODEL_TYPES)} (a model of "
            "another family can still be trained by writing pipeline_layers() around its blocks)"
        )
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False):
        raise ValueError("from_hf takes decoder-only causal LMs (no cross-attention)")
    return FAMILIES[MODEL_TYPES[model_type]]


def _dynamic_options(options: Mapping[str, Any]) -> tuple[bool, int, float]:
    """The ``(early_exit, mod_every, mod_capacity)`` of :meth:`HFCausalLM.configure_dynamics`'s options, checked.

    Args:
        options: the options the dynamics callbacks passed.

    Returns:
        Whether to add exit gates, every how many layers to add a depth router (0: none), and its capacity.

    Raises:
        ValueError: an option Hugging Face layers cannot take, or a value out of range.
    """
    unknown = set(options) - DYNAMIC_OPTIONS
    if unknown:
        raise ValueError(
            f"{sorted(unknown)} cannot apply to a Hugging Face model: Mixture of Experts and dynamic sparse "
            "attention would replace its (pretrained) MLPs or attentions by modules with other weights. Early "
            "exit, Mixture of Depths, freezing and structured pruning work on its layers."
        )
    early_exit = bool(options.get("early_exit", False))
    mod_every, mod_capacity = int(options.get("mod_every", 0)), float(options.get("mod_capacity", 1.0))
    if mod_every < 0 or not 0.0 < mod_capacity <= 1.0:
        raise ValueError(f"mod_every={mod_every} must be >= 0 and mod_capacity={mod_capacity} in (0, 1]")
    return early_exit, mod_every, mod_capacity


def _depth_router(seed: int, index: int, hidden: int, capacity: float) -> DepthRouter:
    """The depth router of pipeline layer ``index``: the same weights on every process and device, whenever built."""
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.manual_seed(layer_seed(seed, index))
        return DepthRouter(hidden, capacity)


def _refuse_padding(mask: Tensor | None) -> None:
    """Refuse an ``attention_mask`` with zeros, read only on the host (a device read stalls the device)."""
    if mask is not None and mask.device.type == "cpu" and not bool(mask.bool().all()):
        raise ValueError(
            "batches with padding (attention_mask with zeros) are not supported by pipeline layers, which build a "
            "plain causal mask: pack the sequences, and mark positions to skip with labels = -100"
        )


def _is_meta(layer: nn.Module) -> bool:
    return any(t.is_meta for t in (*layer.parameters(), *layer.buffers()))


def _hf_parts(layer: nn.Module, tied: bool) -> dict[str, nn.Module]:
    """The Hugging Face modules of a pipeline layer by name (not dynamic parts, not a tied output projection)."""
    if isinstance(layer, Embedding):
        return {name: m for name, m in (("wte", layer.wte), ("wpe", layer.wpe)) if m is not None}
    if isinstance(layer, DecoderLayer):
        return {"layer": layer.layer}
    assert isinstance(layer, Head), type(layer)
    return {"norm": layer.norm} if tied else {"norm": layer.norm, "lm_head": layer.lm_head}


def _layer_prefix(index: int, layer: nn.Module) -> str:
    """Where pipeline layer ``index`` sits in :class:`HFCausalLM` (its state-dict prefix)."""
    if isinstance(layer, Embedding):
        return "embed."
    return f"layers.{index - 1}." if isinstance(layer, DecoderLayer) else "head."


def _split(model: nn.Module, family: Family) -> tuple[Embedding, nn.ModuleList, Head]:
    """Regroup the Hugging Face modules into pipeline layers (the same module objects, nothing copied but rotary)."""
    config = model.config
    wpe = model.get_submodule(family.wpe) if family.wpe else None
    drop = model.get_submodule("transformer.drop") if family.name == "gpt2" else None
    embed = Embedding(model.get_submodule(family.wte), wpe, drop)
    rotary = model.get_submodule(family.rotary) if family.rotary else None
    impl = getattr(config, "_attn_implementation", None) or "eager"
    layer_types = getattr(config, "layer_types", None)
    layers = nn.ModuleList()
    for i, layer in enumerate(model.get_submodule(family.layers)):
        window = getattr(config, "sliding_window", None) if _slides(config, layer_types, i) else None
        layers.append(DecoderLayer(layer, family, copy.deepcopy(rotary) if rotary else None, impl, window))
    head = Head(model.get_submodule(family.norm), model.get_output_embeddings())
    return embed, layers, head


def _slides(config: Any, layer_types: list[str] | None, i: int) -> bool:
    if layer_types is not None:
        return layer_types[i] == "sliding_attention"
    return bool(getattr(config, "sliding_window", None)) and getattr(config, "use_sliding_window", True)


def shift_labels(labels: Tensor) -> Tensor:
    """Hugging Face's shift: token ``t`` predicts label ``t + 1``; the last position has none (``-100``)."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def to_hf_keys(state_dict: Mapping[str, Tensor], family: Family) -> tuple[dict[str, Tensor], list[str]]:
    """Rename a :class:`HFCausalLM` state dict to the Hugging Face model's keys; returns it and the keys left out."""
    prefixes = {
        "embed.wte.": family.wte + ".",
        "embed.wpe.": (family.wpe or "") + ".",
        "head.norm.": family.norm + ".",
        "head.lm_head.": "lm_head.",
    }
    out, left = {}, []
    for key, value in state_dict.items():
        parts = key.split(".")
        if parts[0] == "layers" and parts[2] == "layer":
            out[".".join([family.layers, parts[1], *parts[3:]])] = value
            continue
        prefix = next((p for p in prefixes if key.startswith(p)), None)
        if prefix is None:
            left.append(key)
        else:
            out[prefixes[prefix] + key[len(prefix) :]] = value
    return out, left


def from_hf(
    model_or_config: Any = None, *, pretrained: str | os.PathLike[str] | None = None, **options: Any
) -> HFCausalLM:
    """A pipeline-ready LightningModule from a Hugging Face causal LM, its config, or a local checkpoint.

    From a config or a checkpoint no weights are allocated here: the layers start on the meta device and get their
    weights where they run (:meth:`HFCausalLM.configure_model`; under ``DynMoStrategy`` each stage only its own).

    Args:
        model_or_config: a ``transformers`` causal LM (trained as it is), a ``PretrainedConfig`` or a dict with
            ``model_type`` (each layer initialised by the Hugging Face model's rules from its own seed, see
            :func:`~dynmo_lightning.protocol.layer_seed`); ignored when ``pretrained`` is given.
        pretrained: a local directory written by ``save_pretrained`` (never downloads): its ``config.json`` and
            safetensors weights (one file or shards), each layer reading only its own tensors.
        **options: ``attn_implementation`` (``"sdpa"``, the default, or ``"eager"``; for configs and checkpoints),
            and :class:`HFCausalLM`'s options (``lr``, ``weight_decay``, ``betas``, ``eps``, ``optimizer``,
            ``lr_scheduler``, ``seed``).

    Raises:
        ValueError: an unsupported model family or attention implementation; a checkpoint without safetensors
            weights (pickles can run code) or without some of the model's tensors.
        FileNotFoundError: ``pretrained`` is not a directory.
        ImportError: ``transformers`` is not installed.
    """
    tf = transformers()
    impl = options.pop("attn_implementation", "sdpa")
    if pretrained is None and isinstance(model_or_config, nn.Module):
        return HFCausalLM(model_or_config, **options)
    if pretrained is not None:
        directory = os.fspath(pretrained)
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"pretrained={directory!r} is not a directory written by save_pretrained")
        config = tf.AutoConfig.from_pretrained(directory)
    else:
        config = model_or_config
        if isinstance(config, Mapping):
            config = dict(config)
            config = tf.AutoConfig.for_model(config.pop("model_type"), **config)
        if config is None:
            raise ValueError("from_hf needs a model, a config, or pretrained=PATH")
    _family(config)
    with meta_parameters():
        model = tf.AutoModelForCausalLM.from_config(config, attn_implementation=impl)
    weights = None if pretrained is None else SafetensorsWeights(directory, model.base_model_prefix)
    module = HFCausalLM(model, weights=weights, **options)
    if weights is not None:
        needed = to_hf_keys(module.state_dict(), module.family)[0]
        missing = [k for k in needed if weights.stored_key(k) is None and not (module.tied and k == "lm_head.weight")]
        if missing:
            raise ValueError(f"the checkpoint {directory} lacks {len(missing)} of the model's tensors: {missing[:5]}")
    return module


def save_hf(state_dict: Mapping[str, Tensor], hf_config: Mapping[str, Any], out: str | os.PathLike[str]) -> list[str]:
    """Write an :class:`HFCausalLM` state dict as a Hugging Face checkpoint (``save_pretrained`` of the model).

    Args:
        state_dict: the unsplit module's state dict (e.g. of a checkpoint DynMoStrategy wrote).
        hf_config: the Hugging Face config as a dict (``hyper_parameters["hf_config"]`` of the checkpoint).
        out: the directory to write.

    Returns:
        The keys left out (dynamic parts a Hugging Face model has no place for: exit thresholds, routers).

    Raises:
        ValueError: the weights were structurally pruned (layers of different widths have no Hugging Face config).
    """
    tf = transformers()
    config = dict(hf_config)
    config = tf.AutoConfig.for_model(config.pop("model_type"), **config)
    model = tf.AutoModelForCausalLM.from_config(config)
    weights, left = to_hf_keys(state_dict, _family(config))
    expected = model.state_dict()
    changed = sorted(k for k, v in weights.items() if k in expected and expected[k].shape != v.shape)
    if changed:
        raise ValueError(
            f"cannot export {changed[:3]}...: the model was structurally pruned and its layers have widths a single "
            "Hugging Face config cannot describe; save the module's state_dict instead"
        )
    model.load_state_dict(weights, strict=True)
    model.save_pretrained(os.fspath(out))
    return left
