"""What the tests share and the scripts they start: a package, importable as ``support`` (``tests/`` is on the path).

pytest puts ``tests/`` on ``sys.path`` (``pythonpath`` in ``pyproject.toml``; with ``--import-mode=importlib`` test
files are not importable themselves) and ``tests/conftest.py`` puts it on ``PYTHONPATH``, so that processes the tests
start import these modules by the same names. Modules, imported by tests (``from support.helpers import launch``):

* ``helpers`` - run ``dynmo-train`` in fresh processes (:func:`~support.helpers.launch`), compare runs.
* ``brute`` - brute force over every split, the planners' reference, and hypothesis strategies of problems.
* ``bench_data`` - synthetic benchmark data for the bench and report tests.
* ``fake_slurm`` - a fake ``scontrol`` that records its calls and writes Slurm's resize script.
* ``injected_costs`` - layer costs injected into the balancer's measurements (also a ``dynmo-train`` script).
* ``tied_blocks`` - GPTs that tie parameters by declaration (Hydra targets ``support.tied_blocks.*``).
* ``user_model``, ``classifier_model``, ``hf_models`` - a user's own models, a classifier, tiny Hugging Face models.
* ``moe_models`` - a GPT whose MoE layers run expert by expert; ``memory`` - a peak-bytes counter; ``stages`` - a
  one-process ``LocalStages``.

Scripts, started by path in launched processes (:data:`SUPPORT` ``/ name``): ``_worker`` (several ``dynmo-train``
configurations per launch), ``_elastic_train``, ``_fresh_world_script``, ``_fault_script``, ``_migration_script``,
``_user_script``, ``_classifier_script``, ``_hf_script``, ``_cli_script`` (LightningCLI), ``_sharding_script`` (what
processes hold under ``data_parallel``), ``_summary_script``, ``_weights_only_script``, ``_pruning_script``.
"""

from pathlib import Path

#: This folder: where the scripts started by path are.
SUPPORT = Path(__file__).resolve().parent
