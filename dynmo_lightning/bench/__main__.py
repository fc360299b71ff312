"""``python -m dynmo_lightning.bench``: the ``dynmo-bench`` console script (and its per-process entries)."""

from dynmo_lightning.bench.main import main

main()
