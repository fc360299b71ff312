"""Peak host memory of ``from_hf`` under DynMoStrategy: every process builds only its own stage's layers.

Run (about 5 minutes and 10 GB of memory here; launches its own CPU ranks with ``dynmo_lightning.launch``):
    python examples/bench_hf_memory.py --out docs/bench/bench_hf_memory.json

A Llama config of ~1B parameters (hidden 2048, 16 layers, intermediate 5632, vocabulary 32000), fp32. Each case runs
in fresh processes, which report the peak of their resident set (``VmHWM`` of ``/proc/self/status``):

* ``whole``: one process builds the whole model on the host, which is what ``from_hf(config)`` did in every
  process before the layers started on the meta device (``from_hf(AutoModelForCausalLM.from_config(config))``,
  the same code path today); it then writes the model as a sharded safetensors checkpoint for ``pretrained`` and
  computes the loss of the validation batches.
* ``config``: P processes run ``from_hf(config)`` and ``trainer.validate`` on two batches under ``DynMoStrategy``.
* ``pretrained``: the same with ``from_hf(pretrained=DIR)`` of that checkpoint (each stage reads its own tensors);
  its validation loss equals the whole model's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

BATCHES, BATCH, SEQ = 2, 4, 8


def llama(hidden: int, layers: int, intermediate: int, vocab: int) -> dict[str, Any]:
    """A Llama config (attention heads of width 128, at least one; untied head, short positions)."""
    return {
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": max(1, hidden // 128),
        "num_key_value_heads": max(1, hidden // 128),
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    }


def peak_rss() -> int:
    """The peak resident set of this process so far, in bytes (``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def loader(vocab: int) -> DataLoader:
    """Two small batches of ``(input_ids, next_token_ids)``."""
    tokens = torch.randint(0, vocab, (BATCHES * BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH)


def whole(config: dict[str, Any], checkpoint: Path) -> dict[str, Any]:
    """Build the whole model in this process (the former per-process footprint), save it, score the batches."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dynmo_lightning.models.hf import from_hf

    options = {k: v for k, v in config.items() if k != "model_type"}
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **options))
    module = from_hf(hf)
    built = peak_rss()
    params = sum(p.numel() for p in module.parameters())
    with torch.no_grad():
        losses = [float(module.pipeline_loss(module(x), y)) for x, y in loader(config["vocab_size"])]
    hf.save_pretrained(checkpoint, max_shard_size="500MB")
    return {"params": params, "peak_rss_after_build": built, "loss": sum(losses) / len(losses)}


def stage(case: str, config: dict[str, Any], checkpoint: Path, world_size: int) -> dict[str, Any]:
    """``from_hf`` of the config or the checkpoint, then ``trainer.validate`` under DynMoStrategy (one rank)."""
    import lightning.pytorch as L

    from dynmo_lightning import DynMoStrategy
    from dynmo_lightning.models.hf import from_hf

    module = from_hf(config) if case == "config" else from_hf(pretrained=checkpoint)
    after_from_hf = peak_rss()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=DynMoStrategy(n_microbatches=4, timeout=600),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    metrics = trainer.validate(module, loader(config["vocab_size"]), verbose=False)[0]
    own = sum(p.numel() * p.element_size() for p in module.parameters())
    return {
        "rank": trainer.global_rank,
        "layers_per_stage": trainer.strategy.pipeline_control.layers_per_stage,
        "own_param_bytes": own,
        "peak_rss_after_from_hf": after_from_hf,
        "peak_rss": peak_rss(),
        "val_loss": metrics["val_loss"],
    }


def launch(case: str, world_size: int, work: Path, sizes: list[str]) -> list[dict[str, Any]]:
    """Run ``case`` in ``world_size`` fresh processes; their reports, by rank."""
    from dynmo_lightning.launch import run_ranks

    argv = [sys.executable, __file__, *sizes, "--worker", case, "--work", str(work)]
    codes = run_ranks(world_size, argv, log_dir=work / "logs", tag=case, timeout=1200)
    if any(c != 0 for c in codes):
        logs = "\n".join(p.read_text()[-3000:] for p in sorted((work / "logs").glob(f"{case}.rank*.log")))
        raise SystemExit(f"{case} failed (exit codes {codes}):\n{logs}")
    return [json.loads((work / f"{case}.rank{r}.json").read_text()) for r in range(world_size)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--out", default="bench_hf_memory.json")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--work", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    config = llama(args.hidden, args.layers, args.intermediate, args.vocab)
    if args.worker is not None:
        work, rank, world = Path(args.work), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
        checkpoint = work / "checkpoint"
        report = whole(config, checkpoint) if args.worker == "whole" else stage(args.worker, config, checkpoint, world)
        (work / f"{args.worker}.rank{rank}.json").write_text(json.dumps(report))
        return
    sizes = [f"--{k}={getattr(args, k)}" for k in ("hidden", "layers", "intermediate", "vocab")]
    work = Path(tempfile.mkdtemp(prefix="dynmo-hf-memory-"))
    try:
        reference = launch("whole", 1, work, sizes)[0]
        runs = {case: launch(case, args.processes, work, sizes) for case in ("config", "pretrained")}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    weights = reference["params"] * 4
    result = {
        "command": " ".join(["python", *sys.argv]),
        "config": config,
        "batches": {"count": BATCHES, "batch_size": BATCH, "seq_len": SEQ},
        "params": reference["params"],
        "fp32_weights_bytes": weights,
        "whole_model_in_one_process": {**reference, "fraction_of_weights": reference["peak_rss_after_build"] / weights},
        "processes": args.processes,
        **{
            f"from_{case}": [{**r, "fraction_of_weights": r["peak_rss"] / weights} for r in reports]
            for case, reports in runs.items()
        },
        "versions": {p: version(p) for p in ("torch", "transformers", "lightning")},
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    gib = 2**30
    built = reference["peak_rss_after_build"]
    print(f"whole model in one process: peak RSS {built / gib:.2f} GiB; fp32 weights {weights / gib:.2f} GiB")
    for case, reports in runs.items():
        peaks = [round(r["peak_rss"] / gib, 2) for r in reports]
        print(f"{case}: peak RSS per rank {peaks} GiB, val_loss {reports[0]['val_loss']:.4f}")


if __name__ == "__main__":
    main()
