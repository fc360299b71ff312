"""The reference GPT for compiled-layer tests (Hydra target ``support.strict_compile.StrictCompileGPT``).

Building it starts dynamo afresh in its process and makes dynamo's recompile limit an error. Past the limit (8
graphs of one function, e.g. ``Block.forward``) dynamo runs that function eagerly from then on, silently: a compiled
case would compare eager with eager and pass. And the limit counts per function and per process, so cases run back to
back in one process (``tests/support/_worker.py``) would add up graphs that no single run compiles.
"""

from __future__ import annotations

from typing import Any

import torch._dynamo

from dynmo_lightning.models import GPT


class StrictCompileGPT(GPT):
    """The reference GPT; building it resets dynamo and makes its recompile limit an error."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        torch._dynamo.reset()  # as a new process: no graphs of the cases before
        torch._dynamo.config.fail_on_recompile_limit_hit = True
        super().__init__(*args, **kwargs)
