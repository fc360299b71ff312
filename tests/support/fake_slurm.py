"""A fake ``scontrol`` for tests: records its arguments and writes the resize script Slurm writes after a shrink."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

SCRIPT = """#!{python}
import json, os, sys
from pathlib import Path
with open({log!r}, "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd()}}) + "\\n")
args = dict(a.split("=", 1) for a in sys.argv[2:] if "=" in a)
if {fail}:
    sys.exit("scontrol: error: Job/step already completing or completed")
nodes = args["NodeList"]
n = len(nodes.split(","))
Path(f"slurm_job_{{args['JobId']}}_resize.sh").write_text(
    f'export SLURM_NODELIST="{{nodes}}"\\nexport SLURM_JOB_NODELIST="{{nodes}}"\\nexport SLURM_NNODES={{n}}\\n'
    f'export SLURM_JOB_NUM_NODES={{n}}\\nexport SLURM_JOB_CPUS_PER_NODE="2(x{{n}})"\\nunset SLURM_TASKS_PER_NODE\\n'
)
"""


def install(bin_dir: Path, *, fail: bool = False) -> Path:
    """Write ``bin_dir/scontrol``; returns the log file it appends a JSON line to per call."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    log = bin_dir / "scontrol.log"
    path = bin_dir / "scontrol"
    path.write_text(SCRIPT.format(python=sys.executable, log=str(log), fail=fail))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return log


def calls(log: Path) -> list[dict]:
    """The recorded calls."""
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def env_with(bin_dir: Path, env: dict[str, str]) -> dict[str, str]:
    """``env`` with ``bin_dir`` first on ``PATH``."""
    return {**env, "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', os.environ.get('PATH', ''))}"}
