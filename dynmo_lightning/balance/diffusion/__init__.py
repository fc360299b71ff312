"""Diffusion: the decentralised, neighbour-only partitioning method (imports :mod:`~dynmo_lightning.balance.split`).

* ``driver`` - :func:`~dynmo_lightning.balance.diffusion.driver.diffuse` and a stage's state machine
  (``DiffusionStage``, which the runtime drives point-to-point), dispatching to its mode; the in-memory drivers.
* ``exact_mode`` - mode ``"exact"``: a bound search by push and pull settles, ending on the optimal split.
* ``sweep_mode`` - mode ``"sweep"``: one prefix scan and equal-share cuts in about ``2 P`` rounds.
* ``cards`` - the card a stage shows its neighbours and the outcome it ends on.
* ``stage_state`` - what a stage knows of itself, and the protocol a mode implements.
"""
