"""One rank of a launched job training a tiny Hugging Face model (tests/support/hf_models.py) under DynMoStrategy.

Usage: ``PYTHONPATH=tests python tests/support/_hf_script.py OUT_DIR CASE [CASE ...]`` with the distributed environment
set; a case is ``name:key=value,...`` with keys ``family`` (llama / gpt2), ``random`` (1: the balancer moves layers to a
random split every 3 steps), ``freeze`` (1: layers 0-2 freeze at step 4), ``mod`` (1: Mixture of Depths, :data:`MOD`)
and ``prune`` (1: structured pruning, :data:`PRUNE`); ``cli=1`` runs ``dynmo-train`` (the CLI's ``run``) in
``OUT_DIR/name`` with the overrides listed in ``OUT_DIR/name.json`` instead.
"""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist
from hydra import compose, initialize_config_dir

from dynmo_lightning import DynMoBalancer, DynMoStrategy
from dynmo_lightning.callbacks import GradualPruning, LayerFreezing, MixtureOfDepths
from dynmo_lightning.cli import CONF_DIR, run
from support.hf_models import fit, pipeline_model, save

FREEZE = {0: 4, 1: 4, 2: 4}
MOD = {"capacity": 0.5, "every": 2, "start_step": 3, "anneal_steps": 3}
PRUNE = {"final_sparsity": 0.5, "start_step": 2, "end_step": 8, "every_n_steps": 2}


def main() -> None:
    out = Path(sys.argv[1])
    world_size = int(os.environ["WORLD_SIZE"])  # read once: Lightning's teardown removes it
    for case in sys.argv[2:]:
        name, _, spec = case.partition(":")
        opts = dict(item.split("=") for item in spec.split(",") if item)
        if opts.get("cli") == "1":
            overrides = json.loads((out / f"{name}.json").read_text())
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
                run(compose("config", overrides=[*overrides, f"run_dir={out / name}"]))
            continue
        callbacks = []
        if opts.get("random") == "1":
            callbacks.append(DynMoBalancer(method="random", every_n_steps=3, warmup_steps=0))
        if opts.get("freeze") == "1":
            callbacks.append(LayerFreezing(mode="schedule", schedule=FREEZE, start_step=0))
        if opts.get("mod") == "1":
            callbacks.append(MixtureOfDepths(**MOD))
        if opts.get("prune") == "1":
            callbacks.append(GradualPruning(**PRUNE))
        strategy = DynMoStrategy(n_microbatches=4, timeout=60)
        trainer, losses = fit(pipeline_model(opts["family"]), strategy, devices=world_size, callbacks=callbacks)
        save(trainer, losses, out / f"{name}.json")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
