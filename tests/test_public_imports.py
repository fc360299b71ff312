"""Every name the README and docs/ tell users to import still imports (rooms move; the doors stay).

Import lines in the pages (``from dynmo_lightning... import ...``), dotted names in backticks that name a module or
one of its attributes (``dynmo_lightning.balance.partition``), and the names ``dynmo_lightning.protocol`` has always
gathered for users.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
IMPORT = re.compile(r"from (dynmo_lightning[\w.]*) import \(?([\w, ]+)\)?")
DOTTED = re.compile(r"`(dynmo_lightning(?:\.\w+)+)`")


def _imports() -> set[tuple[str, str]]:
    found = set()
    for page in PAGES:
        for module, names in IMPORT.findall(page.read_text()):
            found |= {(module, name.strip()) for name in names.split(",") if name.strip()}
    return found


def _dotted() -> set[str]:
    return {name for page in PAGES for name in DOTTED.findall(page.read_text())}


@pytest.mark.parametrize(("module", "name"), sorted(_imports()))
def test_every_import_line_of_the_pages_imports(module, name):
    assert hasattr(importlib.import_module(module), name), f"from {module} import {name}"


@pytest.mark.parametrize("dotted", sorted(_dotted()))
def test_every_dotted_name_of_the_pages_resolves(dotted):
    # a module, or an attribute of the longest importable prefix
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return
    pytest.fail(f"{dotted} names nothing")


PROTOCOL = """DeviceScalars JobShape PipelineControl PipelineModule PreLaunchCheck ProtocolError all_gather as_tuple
call_layer check_protocol has_host_value host_value init_layer is_on_host is_probing layer_seed layers_changed
local_layers local_part materialise_layer may_leave_parameters_unused needs_whole_backward on_host pipeline_control
probing read_once
run_layers runs_without_autograd set_host_value split_batch stage_forward stage_memo""".split()


@pytest.mark.parametrize("name", PROTOCOL)
def test_the_protocol_module_keeps_every_name_it_had(name):
    # what dynmo_lightning.protocol held before core/ took its ideas apart, and what callbacks' authors import
    assert hasattr(importlib.import_module("dynmo_lightning.protocol"), name)


#: Module paths of the flat ``pipeline/`` the pages and users' code named before it had parts, and a name of each.
MOVED_PATHS = [
    ("dynmo_lightning.pipeline.sharded", "load_whole"),
    ("dynmo_lightning.pipeline.release", "ReleaseEvent"),
    ("dynmo_lightning.pipeline.layout", "ReplicaLayout"),
    ("dynmo_lightning.pipeline.layout", "shard_dataloader"),  # a module split in parts finds names in each
    ("dynmo_lightning.pipeline.sharding", "full_tensors"),
    ("dynmo_lightning.pipeline.compiled", "graphs"),
    ("dynmo_lightning.pipeline.strategy_settings", "StrategySettings"),
]


@pytest.mark.parametrize(("module", "name"), MOVED_PATHS)
def test_old_pipeline_paths_import_with_a_deprecation_warning(module, name):
    import sys

    sys.modules.pop(module, None)  # imported once per process: warn again here
    with pytest.warns(DeprecationWarning, match="moved to"):
        moved = importlib.import_module(module)
    assert getattr(moved, name).__module__.startswith(("dynmo_lightning.pipeline.", "dynmo_lightning.strategy."))


def test_a_module_that_moved_whole_is_the_same_module_under_both_names():
    import warnings

    from dynmo_lightning.pipeline.checkpoint import sharded

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = importlib.import_module("dynmo_lightning.pipeline.sharded")
    assert old is sharded and sharded.__spec__.name == "dynmo_lightning.pipeline.checkpoint.sharded"
