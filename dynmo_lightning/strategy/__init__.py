"""``DynMoStrategy``, the Lightning face of the pipeline (the top of the runtime: it may import all of ``pipeline/``).

* ``dynmo`` - :class:`DynMoStrategy`: Lightning's hooks, the steps, checkpoints, collectives.
* ``control`` - :class:`PipelineHandle`: the roles callbacks ask for (``core.control``), answered from the strategy.
* ``steps`` - a step's batch as this process runs it: checked, and this replica's part taken.
* ``arguments`` - :class:`StrategySettings`: the strategy's settings, one name and one default each.
* ``checks`` - what the launching process refuses before any worker starts, each with the setting and the fix.
* ``launcher`` - starting the job's processes after those checks.
* ``plugins`` - the strategy's wrapping of the Trainer's plugins: clipping over all stages, atomic checkpoints.
* ``precision`` - the Trainer's precision plugin, with clipping by the pipeline's global gradient norm.
"""

from dynmo_lightning.strategy.dynmo import DynMoStrategy

__all__ = ["DynMoStrategy"]
