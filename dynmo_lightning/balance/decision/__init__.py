"""The decision: keep, migrate or repack, and when to ask (the top of :mod:`dynmo_lightning.balance`).

* ``policy`` - :class:`~dynmo_lightning.balance.BalancePolicy`, THE decision, driven by the runtime balancer and
  replayed by the simulator alike.
* ``cadence`` - :class:`~dynmo_lightning.balance.decision.cadence.PolicyCadence`: the policy's measuring half (its
  tracker, when it profiles, when a check is due, its checkpointed state).
* ``pipeline_shape`` - :class:`~dynmo_lightning.balance.PipelineShape`: the pipeline a policy plans for.
* ``policy_settings`` - :class:`BalanceSettings`: one name, one default and one check per setting.
* ``tracker`` - :class:`~dynmo_lightning.balance.CostTracker`: smoothed per-layer costs and memory.
* ``repack`` - :func:`~dynmo_lightning.balance.plan_repack`: the fewest stages within tolerance, and who keeps running.
"""
