"""Step-time models: what a split costs per step under a schedule (imports ``split`` and ``partitioning``).

* ``makespan`` - torch 2.13's task order of every schedule played out over per-stage times: the makespan engine.
* ``closed_form`` - the fill/drain estimate of GPipe/1F1B, and whether a re-partition pays for its migration.
* ``memory_model`` - every rank's peak memory under the schedule's own order, and during a migration.
* ``planner`` - the makespan-optimal split within memory caps (:class:`~dynmo_lightning.balance.StepModel`).
* ``rank_split`` - balancing ranks, not stages, when every rank holds two.
"""
