"""Hugging Face causal LMs through ``from_hf``: exact pipeline training, the dynamics on their layers, HF export.

The reference for pipeline runs is plain single-device Lightning training the Hugging Face model through its own
``forward`` (tests/support/hf_models.py); no test downloads anything (models are built from configs, randomly
initialised).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from support import SUPPORT
from support.helpers import assert_close_losses, assert_close_model, assert_close_params, launch_script
from support.hf_models import CONFIGS, built, fit, hf_model, hf_state, pipeline_model, reference
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM

from dynmo_lightning.callbacks import (
    DynamicSparseAttention,
    GradualPruning,
    MixtureOfDepths,
    MixtureOfExperts,
    TokenEarlyExit,
)
from dynmo_lightning.cli import CONF_DIR, export
from dynmo_lightning.models.hf import from_hf, save_hf, shift_labels, to_hf_keys
from dynmo_lightning.pipeline.checkpoint.sharded import load_whole

SCRIPT = SUPPORT / "_hf_script.py"
FAMILIES = ["llama", "gpt2"]


def _ids(batch: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(1))


# ---------------------------------------------------------------------------------------------------------------------
# The pipeline layers are the Hugging Face model
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_layers_give_the_hf_models_own_logits_and_loss(family, impl):
    module = built(from_hf(CONFIGS[family], seed=0, attn_implementation=impl))
    hf = hf_model(family)
    hf.config._attn_implementation = impl
    x = _ids()
    out = hf(input_ids=x, labels=x)
    logits = module(x)
    assert torch.equal(logits, out.logits)
    split = module.pipeline_split_batch({"input_ids": x})  # HF-style labels, shifted as HF shifts them
    assert torch.equal(split[1], shift_labels(x)) and split[1][:, -1].eq(-100).all()
    # transformers 5 gives the same bits; 4.x slices the logits before the mean (another summation order)
    torch.testing.assert_close(module.pipeline_loss(logits, split[1]), out.loss, rtol=1e-6, atol=0)
    assert module.tied == (family == "gpt2")


@pytest.mark.parametrize("model_type", ["mistral", "qwen2"])
def test_the_llama_family_shares_the_layout(model_type):
    module = built(from_hf({**CONFIGS["llama"], "model_type": model_type}, seed=0))
    hf = hf_model("llama", model_type=model_type)
    x = _ids()
    assert torch.equal(module(x), hf(input_ids=x).logits)
    layer = module.layers[0]  # Qwen2 has query/key/value biases: pruned with their rows
    layer.attn_units.keep_units(torch.tensor([1]))
    layer.mlp_units.keep_units(torch.arange(16))
    attn = layer.layer.self_attn
    assert attn.k_proj.weight.shape[0] == 8 and attn.q_proj.weight.shape[0] == 16 and module(x).shape == (2, 16, 128)
    assert model_type == "mistral" or attn.k_proj.bias.shape[0] == 8


def test_without_transformers_the_error_says_how_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # what `import transformers` sees when it is missing
    with pytest.raises(ImportError, match=r"pip install 'dynmo-lightning\[hf\]'"):
        from_hf(CONFIGS["llama"])


def test_from_hf_refuses_what_it_cannot_split():
    from transformers import AutoConfig

    with pytest.raises(ValueError, match="model_type='bert' is not supported"):
        from_hf(AutoConfig.for_model("bert", vocab_size=64, hidden_size=32, num_hidden_layers=1))
    with pytest.raises(ValueError, match="attn_implementation='flex_attention' is not supported"):
        from_hf(CONFIGS["llama"], attn_implementation="flex_attention")
    module = pipeline_model("llama")
    with pytest.raises(ValueError, match="padding"):
        module.pipeline_split_batch({"input_ids": _ids(), "attention_mask": torch.zeros(2, 16)})
    windowed = built(from_hf({**CONFIGS["llama"], "model_type": "mistral", "sliding_window": 8}))
    with pytest.raises(ValueError, match="sliding attention window 8"):
        windowed(_ids())
    with pytest.raises(ValueError, match="cannot both act"):
        module.configure_dynamics(early_exit=True, mod_every=2)
    for callback in (MixtureOfExperts(), DynamicSparseAttention()):  # they would replace the trained MLP/attention
        with pytest.raises(ValueError, match="cannot apply to a Hugging Face model"):
            callback.setup(None, module, "fit")


# ---------------------------------------------------------------------------------------------------------------------
# Weights: none allocated by from_hf; each layer materialised where it runs, initialised or read by key
# ---------------------------------------------------------------------------------------------------------------------
def _stage(module, rank: int, layers_per_stage: tuple[int, ...]):
    """Split ``module`` as DynMoStrategy does on pipeline ``rank`` (layers made in its meta-device context)."""
    from dynmo_lightning.pipeline.stage.cut import pipeline_layers, split_module
    from dynmo_lightning.pipeline.stage.runtime import StagePlan

    with torch.device("meta"):  # what DynMoStrategy.model_sharded_context gives configure_model
        module.configure_model()
    plan = StagePlan(layers_per_stage, len(layers_per_stage))
    split_module(module, pipeline_layers(module), plan, rank, torch.device("cpu"), module.pipeline_init_seed)
    return plan.layers_of_rank(rank)


def _real_bytes(layer: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in layer.parameters() if not t.is_meta)


def _layer_of(key: str, n_layers: int) -> int:
    """The pipeline layer of a :class:`HFCausalLM` state-dict key."""
    top, *rest = key.split(".")
    if top == "layers":
        return int(rest[0]) + 1
    return 0 if top == "embed" else n_layers - 1


@pytest.mark.parametrize("family", FAMILIES)
def test_from_hf_allocates_no_weights_and_a_stage_builds_only_its_own_layers(family):
    module = pipeline_model(family)
    assert all(p.is_meta for p in module.parameters())
    whole = built(pipeline_model(family)).state_dict()
    tie = {"head.lm_head.weight"} if module.tied else set()  # the tie's value comes from the embedding's stage
    for rank in (0, 1):
        stage = pipeline_model(family)
        mine = _stage(stage, rank, (3, 3))
        for i, layer in enumerate(stage.pipeline_layers()):
            assert _real_bytes(layer) > 0 if i in mine else getattr(layer, "pipeline_remote", False)
        state = {k: v for k, v in stage.state_dict().items() if k not in tie}
        assert state.keys() == {k for k in whole if _layer_of(k, 6) in mine} - tie
        for key, value in state.items():  # layer i has the same weights on any stage as in the whole model
            assert torch.equal(value, whole[key]), key


@pytest.mark.parametrize("family", FAMILIES)
def test_random_layers_follow_the_hf_models_own_initialisation(family):
    from transformers import AutoConfig

    config = dict(CONFIGS[family])
    reference = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config)).state_dict()
    ours = built(pipeline_model(family)).hf_state_dict()
    assert ours.keys() == reference.keys()
    for key, ref in reference.items():
        if ref.is_floating_point() and ref.numel() > 1 and ref.std() > 0:  # drawn: the same distribution
            assert abs(ours[key].std() / ref.std() - 1) < 0.2 and abs(ours[key].mean()) < 0.01, key
        else:  # constants (norms, biases, masks): the same values
            assert torch.equal(ours[key], ref), key


def _record_reads(monkeypatch) -> list[str]:
    """Every tensor key the safetensors files are asked for from now on."""
    import safetensors

    reads, real = [], safetensors.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self._f = real(*args, **kwargs)

        def __enter__(self):
            self._f.__enter__()
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

        def keys(self):
            return self._f.keys()

        def get_tensor(self, key):
            reads.append(key)
            return self._f.get_tensor(key)

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    return reads


@pytest.mark.parametrize("shards", ["one file", "shards"])
@pytest.mark.parametrize("family", FAMILIES)
def test_pretrained_stages_read_only_their_own_tensors(tmp_path, monkeypatch, family, shards):
    hf = hf_model(family, seed=5)
    hf.save_pretrained(tmp_path, **({"max_shard_size": "20KB"} if shards == "shards" else {}))
    assert (tmp_path / "model.safetensors.index.json").is_file() == (shards == "shards")
    reads = _record_reads(monkeypatch)
    whole = built(from_hf(pretrained=tmp_path))
    x = _ids()
    with torch.no_grad():
        assert torch.equal(whole(x), hf(input_ids=x).logits)
    saved = set(reads)
    assert saved == set(hf.state_dict()) - ({"lm_head.weight"} if whole.tied else set())
    for rank, layers_per_stage in ((0, (2, 4)), (1, (2, 4))):
        reads.clear()
        stage = from_hf(pretrained=tmp_path)
        mine = _stage(stage, rank, layers_per_stage)
        expected = {k for k in to_hf_keys(stage.state_dict(), stage.family)[0] if k in saved}
        assert len(reads) == len(set(reads)) and set(reads) == expected  # each of this stage's tensors, once
        assert (0 in mine) == any(k.startswith(stage.family.wte) for k in reads)


def test_pretrained_refuses_pickles_and_incomplete_checkpoints(tmp_path):
    hf = hf_model("llama")
    hf.config.save_pretrained(tmp_path / "pickle")
    torch.save(hf.state_dict(), tmp_path / "pickle" / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"no safetensors weights .*pytorch_model\.bin.*can run code"):
        from_hf(pretrained=tmp_path / "pickle")
    hf_model("llama", num_hidden_layers=2).save_pretrained(tmp_path / "short")
    config = json.loads((tmp_path / "short" / "config.json").read_text())
    (tmp_path / "short" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4}))
    with pytest.raises(ValueError, match=r"lacks 18 of the model's tensors: \['model.layers.2."):
        from_hf(pretrained=tmp_path / "short")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        from_hf(pretrained=tmp_path / "absent")


def test_dynamic_parts_are_the_same_built_before_or_after_the_weights():
    before = pipeline_model("llama")
    before.configure_dynamics(mod_every=2, mod_capacity=0.5)
    after = built(pipeline_model("llama"))
    after.configure_dynamics(mod_every=2, mod_capacity=0.5)
    assert torch.equal(torch.cat([p.flatten() for p in built(before).parameters()]),
                       torch.cat([p.flatten() for p in after.parameters()]))  # fmt: skip
    assert before.layers[1].depth_router.k(16) == 8
    gated = pipeline_model("gpt2")
    gated.configure_dynamics(early_exit=True)
    assert all(float(layer.exit_gate.threshold) == 2.0 for layer in built(gated).layers)  # no exits until scheduled


def test_padding_is_refused_on_the_host_and_a_device_mask_is_never_read():
    module = pipeline_model("llama")
    padded = {"input_ids": _ids(), "attention_mask": torch.ones(2, 16).index_fill(1, torch.tensor([15]), 0)}
    with pytest.raises(ValueError, match="padding"):
        module.on_before_batch_transfer(padded, 0)  # Lightning's loops, before the batch moves to the device
    assert module.on_before_batch_transfer({"input_ids": _ids()}, 0)["input_ids"].shape == (2, 16)
    on_device = {"input_ids": _ids(), "attention_mask": torch.zeros(2, 16, device="meta")}  # any read would raise
    inputs, labels = module.pipeline_split_batch(on_device)
    assert torch.equal(inputs, _ids()) and torch.equal(labels, shift_labels(_ids()))


# ---------------------------------------------------------------------------------------------------------------------
# Structured pruning
# ---------------------------------------------------------------------------------------------------------------------
def _flops(layer: torch.nn.Module, h: torch.Tensor) -> int:
    with FlopCounterMode(display=False) as counter:
        layer(h)
    return counter.get_total_flops()


@pytest.mark.parametrize("family", FAMILIES)
def test_pruning_shrinks_flops_and_equals_the_masked_dense_layer(family):
    module = built(pipeline_model(family))
    layer = module.layers[1]
    h = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(2))
    neurons = torch.tensor([0, 3, 5, *range(10, 40)])
    groups = torch.tensor([1]) if family == "llama" else torch.tensor([0, 2, 3])  # KV group 1 = query heads 2, 3
    # The masked dense layer: pruned units contribute nothing (their output-projection columns/rows zeroed).
    with torch.no_grad():
        if family == "llama":
            attn, mlp = layer.layer.self_attn, layer.layer.mlp
            down, o = mlp.down_proj.weight, attn.o_proj.weight
            down[:, [j for j in range(down.shape[1]) if j not in neurons]] = 0
            o[:, [c for c in range(32) if c // 16 not in groups]] = 0  # head_dim 8, 2 query heads per group
        else:
            attn, mlp = layer.layer.attn, layer.layer.mlp
            proj, o = mlp.c_proj.weight, attn.c_proj.weight
            proj[[j for j in range(proj.shape[0]) if j not in neurons]] = 0
            o[[c for c in range(32) if c // 8 not in groups]] = 0
        dense = layer(h)
    before = _flops(layer, h)
    layer.mlp_units.keep_units(neurons)
    layer.attn_units.keep_units(groups)
    assert layer.mlp_units.n_units() == len(neurons) and layer.attn_units.n_units() == len(groups)
    with torch.no_grad():
        pruned = layer(h)
    torch.testing.assert_close(pruned, dense, rtol=1e-5, atol=1e-6)
    after = _flops(layer, h)
    assert after < 0.7 * before, (after, before)


def test_gradual_pruning_prunes_llama_units_and_a_pruned_checkpoint_loads(tmp_path):
    module = pipeline_model("llama")
    pruning = GradualPruning(final_sparsity=0.5, start_step=2, end_step=8, every_n_steps=2)
    trainer, losses = fit(module, callbacks=[pruning])
    assert all(torch.isfinite(torch.tensor(losses)))
    widths = [layer.mlp_units.n_units() for layer in module.layers]
    groups = [layer.attn_units.n_units() for layer in module.layers]
    assert sum(widths) == 128 and sum(groups) == 4 and min(widths) < max(widths)
    for layer in module.layers:  # optimizer state sliced with the weights
        w = layer.layer.mlp.gate_proj.weight
        assert trainer.optimizers[0].state[w]["exp_avg"].shape == w.shape
    fresh = built(pipeline_model("llama"))
    fresh.load_state_dict(module.state_dict())  # a pruned checkpoint resumes pruned
    x = _ids()
    torch.testing.assert_close(fresh(x), module(x))


def test_unstructured_pruning_masks_gpt2_conv1d_weights():
    from transformers.pytorch_utils import Conv1D

    module = pipeline_model("gpt2")
    pruning = GradualPruning(final_sparsity=0.5, start_step=1, end_step=3, every_n_steps=1, mode="unstructured")
    fit(module, callbacks=[pruning])
    weights = [m.weight for layer in module.pipeline_layers()[:-1] for m in layer.modules() if isinstance(m, Conv1D)]
    assert weights, "GPT-2's projections are Conv1D modules"
    zeros = sum(int((w == 0).sum()) for w in weights) / sum(w.numel() for w in weights)
    assert zeros == pytest.approx(0.5, abs=0.02)  # global magnitude: the Conv1D weights share the 50 %


def test_export_leaves_out_dynamic_parts_and_refuses_pruned_widths(tmp_path):
    module = pipeline_model("llama")
    module.configure_dynamics(mod_every=2, mod_capacity=0.5)
    built(module)
    left = save_hf(module.state_dict(), module.hparams["hf_config"], tmp_path / "hf")
    assert left and all(".depth_router." in k for k in left)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(loaded.lm_head.weight, module.head.lm_head.weight)
    module.layers[0].mlp_units.keep_units(torch.arange(32))
    with pytest.raises(ValueError, match="structurally pruned"):
        save_hf(module.state_dict(), module.hparams["hf_config"], tmp_path / "pruned")


def _loop_scores(units) -> torch.Tensor:
    """What ``unit_scores`` computed before it was vectorised: one unit at a time, a sum per part and unit."""
    n = units.n_units()
    energies = [
        p.detach().float().square().sum([d for d in range(p.dim()) if d != dim]) if p.dim() > 1 else
        p.detach().float().square()
        for p, dim, _ in units._parts(torch.arange(n))
    ]  # fmt: skip
    scores = [
        sum(e[i.reshape(-1)].sum() for e, (_, _, i) in zip(energies, units._parts(torch.tensor([j])), strict=True))
        for j in range(n)
    ]
    return torch.stack(scores).sqrt()


def _old_spans(units: torch.Tensor, width: int, offset: int = 0) -> torch.Tensor:
    """The indices ``_spans`` gave before (a CPU ``arange`` added to the units' indices)."""
    return (offset + units[:, None] * width + torch.arange(width)).reshape(-1)


def _old_indices(units, keep: torch.Tensor) -> list[torch.Tensor]:
    """The indices along each part's dimension that the units' ``_parts`` gave before, part by part."""
    t = units.target
    if hasattr(t, "gate_proj"):
        return [keep] * (3 + sum(lin.bias is not None for lin in (t.gate_proj, t.up_proj)))
    if hasattr(t, "c_fc"):
        return [keep] * 3
    D = t.head_dim
    if hasattr(t, "q_proj"):
        per_group = t.q_proj.weight.shape[0] // t.k_proj.weight.shape[0]
        kv, q = _old_spans(keep, D), _old_spans(keep, per_group * D)
        biases = [r for lin, r in ((t.q_proj, q), (t.k_proj, kv), (t.v_proj, kv)) if lin.bias is not None]
        return [q, kv, kv, q, *biases]
    S = t.c_proj.weight.shape[0]
    cols = torch.cat([_old_spans(keep, D, c * S) for c in range(3)])
    return [cols, cols, _old_spans(keep, D)]


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gpt2"])
def test_vectorised_unit_scores_and_indices_equal_the_per_unit_loop(model_type):
    family = "gpt2" if model_type == "gpt2" else "llama"
    module = built(from_hf({**CONFIGS[family], "model_type": model_type, "num_key_value_heads": 4}, seed=3))
    for layer in module.layers:
        for units in (layer.mlp_units, layer.attn_units):
            for _ in range(2):  # the full layer, then after pruning by the scores
                scores = units.unit_scores()
                assert torch.equal(scores, _loop_scores(units))
                keep = scores.topk(max(1, units.n_units() * 3 // 4)).indices.sort().values
                old = _old_indices(units, keep)
                new = [index.reshape(-1) for _, _, index in units._parts(keep)]
                assert len(new) == len(old) and all(torch.equal(a, b) for a, b in zip(new, old, strict=True))
                units.keep_units(keep)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gpt2"])
def test_pruning_scores_and_slices_on_the_weights_device(model_type):
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError, FakeTensorMode

    family = "gpt2" if model_type == "gpt2" else "llama"
    layer = from_hf({**CONFIGS[family], "model_type": model_type}).layers[0]  # meta device: nothing to copy
    with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
        layer.to_empty(device="cuda")  # fake CUDA tensors: mixing them with CPU tensors raises, as CUDA would
        with pytest.raises(FakeTensorDeviceMismatchError):  # what `_spans` did when pruning a CUDA model's heads
            torch.arange(2, device="cuda").unsqueeze(1) * 8 + torch.arange(8)  # ([:, None] needs a CUDA build here)
        for units in (layer.mlp_units, layer.attn_units):
            scores = units.unit_scores()
            assert scores.device.type == "cuda" and scores.shape == (units.initial_units,)
            units.keep_units(scores.topk(units.n_units() // 2).indices.sort().values)
            units.keep_units(torch.tensor([0]))  # a selection made on the host moves to the weights
            assert units.n_units() == 1 and all(p.device.type == "cuda" for p in units.parameters())


# ---------------------------------------------------------------------------------------------------------------------
# Early exit and Mixture of Depths around decoder layers
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_enabled_but_nothing_skipped_is_exactly_dense(family):
    x = _ids()
    dense = built(pipeline_model(family))(x)
    for options in ({"early_exit": True}, {"mod_every": 2, "mod_capacity": 1.0}):
        module = pipeline_model(family)
        module.configure_dynamics(**options)
        logits, aux = built(module)(x)
        assert torch.equal(logits, dense) and float(aux.sum()) == 0.0


@pytest.mark.parametrize("family", FAMILIES)
def test_early_exit_computes_active_tokens_as_the_dense_layer_does(family):
    module = pipeline_model(family)
    module.configure_dynamics(early_exit=True)
    layer = built(module).layers[2]
    h = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(4))
    active = (torch.rand(2, 16, generator=torch.Generator().manual_seed(5)) < 0.6).float()
    with torch.no_grad():
        dense = layer(h)
        y, _, _ = layer(h, active, torch.zeros(2))
    on = active.bool()
    torch.testing.assert_close(y[on], dense[on], rtol=1e-5, atol=1e-5)  # rotary and grouped KV heads included
    assert torch.equal(y[~on], h[~on])  # exited tokens pass unchanged


def test_mixture_of_depths_routes_tokens_at_their_own_rotary_positions():
    module = pipeline_model("llama")
    module.configure_dynamics(mod_every=2, mod_capacity=0.5)
    layer, rotary = built(module).layers[1], hf_model("llama").model.rotary_emb
    h = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        y, _, aux = layer(h, torch.ones(2, 16), torch.zeros(2))
        top = layer.depth_router.top(layer.depth_router.scores(h))
        assert top.shape == (2, 8)
        sub = h.gather(1, top[..., None].expand(-1, -1, 32))
        expected = layer.layer(sub, attention_mask=None, position_embeddings=rotary(sub, top))
        expected = expected[0] if isinstance(expected, tuple) else expected  # transformers < 5 returns a tuple
    torch.testing.assert_close(y.gather(1, top[..., None].expand(-1, -1, 32)), expected)
    assert (y != h).any(-1).sum() == 16 and float(aux.sum()) > 0  # 8 tokens per sequence went through


@pytest.mark.parametrize("family", FAMILIES)
def test_early_exit_and_mod_callbacks_train_hf_models(family):
    exits = TokenEarlyExit(threshold=0.5, warmup_steps=2, ramp_steps=0, log_every_n_steps=100)
    module = pipeline_model(family)
    _, losses = fit(module, callbacks=[exits])
    assert all(torch.isfinite(torch.tensor(losses)))
    gates = [layer.exit_gate for layer in module.layers]
    assert all(g is not None for g in gates) and sum(g.exited for g in gates) > 0
    mod = MixtureOfDepths(capacity=0.5, every=2, start_step=2, anneal_steps=4, log_every_n_steps=100)
    module = pipeline_model(family)
    _, losses = fit(module, callbacks=[mod])
    routers = [layer.depth_router for layer in module.layers if layer.depth_router is not None]
    assert len(routers) == 2 and all(r.router.weight.grad is not None for r in routers)
    assert all(torch.isfinite(torch.tensor(losses)))


# ---------------------------------------------------------------------------------------------------------------------
# Pipeline runs (launched processes) equal plain single-device Lightning; the checkpoint exports to HF
# ---------------------------------------------------------------------------------------------------------------------
#: `dynmo-train` at P=2 on a small `model=hf_llama`, with freezing and the balancer.
CLI = [
    "model=hf_llama",
    "model.model_or_config.hidden_size=32",
    "model.model_or_config.intermediate_size=64",
    "data.block_size=32",
    "data.batch_size=8",
    "data.max_bytes=100000",
    "trainer.devices=2",
    "trainer.max_steps=8",
    "trainer.limit_val_batches=1",
    "trainer.val_check_interval=4",
    "trainer.enable_progress_bar=false",
    "logger.csv=false",
    "strategy.timeout=60",
    *["dynamics=freezing", "dynamics.mode=schedule", "dynamics.schedule={0:3,1:3}", "dynamics.start_step=0"],
    *["balancer=optimal", "balancer.every_n_steps=4", "balancer.warmup_steps=1"],
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    (d / "cli-llama.json").write_text(json.dumps(CLI))
    logs = d / "logs"
    launch_script(1, SCRIPT, str(d), "llama-p1:family=llama", "gpt2-p1:family=gpt2", log_dir=logs)
    launch_script(
        2,
        SCRIPT,
        str(d),
        "llama-p2:family=llama",
        "gpt2-p2:family=gpt2",
        "llama-p2-freeze:family=llama,freeze=1,random=1",
        "llama-p2-mod:family=llama,mod=1",
        "llama-p2-prune:family=llama,prune=1,random=1",
        "cli-llama:cli=1",
        log_dir=logs,
    )
    launch_script(4, SCRIPT, str(d), "llama-p4:family=llama,random=1", "gpt2-p4:family=gpt2,random=1", log_dir=logs)
    return d


@pytest.fixture(scope="module")
def references():
    return {family: reference(family) for family in FAMILIES}


def _load(d: Path, name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    losses = json.loads((d / f"{name}.json").read_text())["losses"]
    return losses, load_whole(d / f"{name}.ckpt")["state_dict"]


def _assert_close_weights(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], family: str) -> None:
    """The whole model and every matrix within 1e-5 (relative); bias and norm vectors of GPT-2 within 1e-4.

    Pipeline runs sum micro-batch gradients in another order. Where a gradient is near zero Adam turns that rounding
    noise into full steps: GPT-2's key bias (softmax ignores it, its gradient is zero up to rounding, left out) and,
    less, its other bias vectors (up to 1e-5 apart after 12 steps, 2e-5 at a 3x learning rate); Llama has no biases.
    """
    assert_close_model(ours, ref)
    matrices = [k for k in ref if ref[k].dim() >= 2]
    assert_close_params({k: ours[k] for k in matrices}, {k: ref[k] for k in matrices})
    vectors = [k for k in ref if ref[k].dim() < 2]
    key_bias = {k: ref[k].shape[0] // 3 for k in vectors if k.endswith("attn.c_attn.bias")}

    def drop(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {k: state[k] for k in vectors}
        out.update({k: torch.cat([state[k][:S], state[k][2 * S :]]) for k, S in key_bias.items()})
        return out

    assert_close_params(drop(ours), drop(ref), rtol=1e-4 if family == "gpt2" else 1e-5)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["llama-p1", "llama-p2", "llama-p4", "gpt2-p1", "gpt2-p2", "gpt2-p4"])
def test_pipeline_equals_plain_lightning_training_the_hf_model(runs, references, name):
    family = name.split("-")[0]
    losses, state = _load(runs, name)
    assert len(losses) == 12
    assert_close_losses(losses, references[family]["losses"])
    _assert_close_weights(hf_state(state, family), references[family]["state"], family)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_freezing_and_rebalancing_an_hf_model_equal_plain_lightning(runs):
    from dynmo_lightning.callbacks import LayerFreezing

    module = pipeline_model("llama")
    _, expected = fit(module, callbacks=[LayerFreezing(mode="schedule", schedule={0: 4, 1: 4, 2: 4}, start_step=0)])
    losses, state = _load(runs, "llama-p2-freeze")
    assert_close_losses(losses, expected)
    assert_close_params(state, module.state_dict())
    assert not module.layers[1].layer.mlp.up_proj.weight.requires_grad


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ["mod", "prune"])
def test_mod_and_pruning_on_an_hf_model_in_a_pipeline_equal_plain_lightning(runs, case):
    from support._hf_script import MOD, PRUNE

    module = pipeline_model("llama")
    callback = MixtureOfDepths(**MOD) if case == "mod" else GradualPruning(**PRUNE)
    _, expected = fit(module, callbacks=[callback])
    losses, state = _load(runs, f"llama-p2-{case}")
    assert_close_losses(losses, expected)
    assert_close_params(state, module.state_dict())  # pruned shapes (and moved pruned layers) included
    if case == "mod":  # routers on stage 0 learn through the auxiliary loss carried to the last stage
        assert any(".depth_router.router.weight" in k for k in state)
    else:
        assert sum(state[f"layers.{i}.layer.mlp.up_proj.weight"].shape[0] for i in range(4)) == 128


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", FAMILIES)
def test_the_pipeline_checkpoint_exports_to_hf_and_loads_with_from_pretrained(runs, tmp_path, family):
    ckpt = runs / f"{family}-p2.ckpt"  # sharded: every stage wrote its own layers
    export([str(ckpt), str(tmp_path / "hf"), "--hf"])
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="sdpa")
    module = built(pipeline_model(family))
    module.load_state_dict(load_whole(ckpt)["state_dict"])
    x = _ids()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, module(x), rtol=0, atol=0)
    again = built(from_hf(pretrained=tmp_path / "hf"))  # back in as a pipeline model (what model.pretrained=PATH does)
    with torch.no_grad():
        torch.testing.assert_close(again(x), module(x), rtol=0, atol=0)
    if family == "gpt2":
        assert loaded.lm_head.weight is loaded.transformer.wte.weight


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dynmo_train_model_hf_llama_with_freezing_and_the_balancer_exports_to_hf(runs, tmp_path):
    run_dir = runs / "cli-llama"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["world_size_end"] == 2
    ckpt = run_dir / "checkpoints" / "final.ckpt"
    export([str(ckpt), str(tmp_path / "hf"), "--hf"])
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[*CLI[:5], f"model.pretrained={tmp_path / 'hf'}", "run_dir=/x"])
    again = built(instantiate(cfg.model, _convert_="all"))  # model.pretrained=PATH: the trained weights, pipeline-ready
    state = load_whole(ckpt)["state_dict"]
    assert again.state_dict().keys() == state.keys()
    assert_close_params(again.state_dict(), state, rtol=0)
    x = _ids()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=x).logits, again(x))


@pytest.mark.parametrize("name", ["hf_llama", "hf_gpt2"])
def test_hydra_model_configs_build_hf_models(tmp_path, name):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"model={name}", "data.block_size=32", "run_dir=/tmp/x"])
    module = instantiate(cfg.model, _convert_="all")
    assert len(module.pipeline_layers()) == 6 and module.hparams.lr == cfg.model.lr
    module.hf_state_dict()
    hf = hf_model("llama")
    hf.save_pretrained(tmp_path / "local")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"model={name}", f"model.pretrained={tmp_path / 'local'}", "run_dir=/x"])
    module = built(instantiate(cfg.model, _convert_="all"))
    x = _ids()
    with torch.no_grad():
        assert torch.equal(module(x), hf(input_ids=x).logits)
