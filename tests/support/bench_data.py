"""Synthetic benchmark data for the bench and report tests: known numbers instead of timings."""

from __future__ import annotations

from pathlib import Path


def cost(fwd: float, bwd: float) -> dict[str, float]:
    return {"fwd": fwd, "bwd": bwd, "activation_bytes": 0.0}


def synthetic_table() -> dict:
    """Costs proportional to what is computed: halves scale with their kept share, the rest with the token share."""
    axis = (0.25, 0.5, 1.0)
    return {
        "shape": {"hidden": 64, "heads": 4, "seq": 64, "micro_batch": 1, "vocab": 256},
        "block": {"trainable": cost(1.0, 2.0), "frozen": cost(0.9, 0.0)},
        "attention": {str(k): cost(0.4 * k, 0.8 * k) for k in axis},
        "mlp": {str(k): cost(0.6 * k, 1.2 * k) for k in axis},
        "exit": {str(k): cost(0.2 + 0.8 * k, 0.4 + 1.6 * k) for k in axis},
        "mod": {str(k): cost(k, 2 * k) for k in axis},
        "sparse": {str(k): cost(0.7 + 0.3 * k, 1.4 + 0.6 * k) for k in axis},
        "expert": {"8": cost(0.1, 0.2), "16": cost(0.2, 0.4)},
        "moe_rest": cost(0.5, 1.0),
        "embedding": cost(0.01, 0.02),
        "head": cost(2.0, 4.0),
    }


def frozen_prefix_trace(n_steps: int = 60, n_layers: int = 16, freeze_at: int = 20) -> list[dict]:
    """Equal layers whose first half freezes (no backward) at ``freeze_at``: a profiler-format cost trace."""
    trace = []
    for step in range(n_steps):
        frozen = step >= freeze_at
        trace.append(
            {
                "step": step,
                "fwd": [1.0] * n_layers,
                "bwd": [0.0 if frozen and i < n_layers // 2 else 2.0 for i in range(n_layers)],
                "param_bytes": [1e6] * n_layers,
                "optim_bytes": [2e6] * n_layers,
                "activation_bytes": [1e6] * n_layers,
                "changed_layers": list(range(n_layers // 2)) if step == freeze_at else [],
            }
        )
    return trace


def write_bench_dir(path: Path) -> Path:
    """A ``dynmo-bench`` directory of known numbers: layer costs, a real A/B summary, a simulation with its trace."""
    from dynmo_lightning.bench import write_json
    from dynmo_lightning.bench.real import summarize
    from dynmo_lightning.bench.scale import Network, compare, seed_reached
    from dynmo_lightning.sim import save_trace

    table = synthetic_table() | {"machine": {"cpu": "test-cpu", "torch": "2.13.0"}, "threads": 2}
    table["shape"] |= {"mlp_ratio": 4, "n_experts": 8, "attn_block": 16}
    write_json(path / "layer_costs.json", table)

    link = {"p2p_latency_s": 1e-4, "p2p_bytes": 1000, "p2p_bytes_per_s": 1e9}
    cases, results = [], {}
    for repeat, (u, d) in enumerate([(100.0, 120.0), (110.0, 125.0), (105.0, 122.0)]):
        for policy, speed in (("uniform", u), ("optimal", d)):
            name = f"freezing-{policy}-{repeat}"
            cases.append({"name": name, "dynamic": "freezing", "policy": policy, "repeat": repeat,
                          "world_size": 2, "microbatches": 4})  # fmt: skip
            results[name] = {"tokens_per_s": speed, "val_loss": 2.5, "partitions": [], "events": [10, 25],
                             "moves": [12, 27], "profile_every_n_steps": 5,
                             "window_costs": {"fwd": [1.0] * 4, "bwd": [0.0, 0.0, 2.0, 2.0]}}  # fmt: skip
    config = {"world_size": 2, "model": {"n_layer": 2, "n_embd": 32}, "data": {"batch_size": 8, "block_size": 16},
              "microbatches": 4, "steps": 40, "measure_from": 30, "repeats": 3}  # fmt: skip
    write_json(path / "real.json", {"config": config, "link": link, "rows": summarize(cases, results, link)})

    net = Network(p2p_latency=1e-4, p2p_bandwidth=1e9, migration_bandwidth=1e9)
    sim: dict = {"network": net.__dict__, "stages": [2, 4], "dynamics": {}}
    two = ("uniform", "optimal")
    for dynamic, freeze_at in (("none", 10**6), ("freezing", 20)):
        trace = frozen_prefix_trace(freeze_at=freeze_at)
        save_trace(trace, path / "traces" / f"{dynamic}.jsonl.gz")
        entry: dict = {"strength": None if dynamic == "none" else 0.5, "val_loss": 2.5, "val_loss_none": 2.4}
        entry["by_stages"] = {str(p): compare(trace, p, net) for p in (2, 4)}

        def headline(cmp: dict) -> dict:
            optimal = cmp["policies"]["optimal"]
            return {"oracle_speedup": cmp["oracle"]["speedup"], "optimal_speedup": optimal["speedup"],
                    "share_of_oracle": optimal["share_of_oracle"]}  # fmt: skip

        entry["bandwidth_sweep"] = [{"bytes_per_s": 1e9, **headline(compare(trace, 4, net, policies=two))}]
        if dynamic == "freezing":
            entry["strength_sweep"] = [
                {"strength": s, "val_loss": 2.5, **headline(compare(frozen_prefix_trace(freeze_at=a), 4, net))}
                for s, a in ((0.5, 40), (0.75, 20))
            ]
            entry["seed_reached"] = seed_reached(entry["strength_sweep"], 2.23)
        sim["dynamics"][dynamic] = entry
    write_json(path / "simulated.json", sim)
    return path
