"""One rank of a multi-process test launch: runs several dynmo-train configurations in the same processes.

Importing Lightning costs seconds per process on the test machines, so a launch of N processes runs a list of cases
back to back (same world, same process group), each through the CLI's own ``run(cfg)`` with a composed Hydra config.
Usage (by tests/_helpers.py): ``python tests/_worker.py SPEC.json`` with the distributed env vars set; with
``"inject_costs": true`` in the spec the balancer sees structural layer costs instead of timings
(``tests/injected_costs.py``).
"""

import json
import sys
import traceback
from pathlib import Path

import injected_costs
import torch.distributed as dist
from hydra import compose, initialize_config_dir

from dynmo_lightning.cli import CONF_DIR, run


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    if spec.get("inject_costs"):
        injected_costs.inject()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for case in spec["cases"]:
            cfg = compose("config", overrides=[*case["overrides"], f"run_dir={case['run_dir']}"])
            try:
                run(cfg)  # a process released by consolidation leaves here with SystemExit(0)
            except Exception:
                traceback.print_exc()
                sys.exit(17)
    if dist.is_initialized():  # leave the job cleanly: no process group threads alive at interpreter exit
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
