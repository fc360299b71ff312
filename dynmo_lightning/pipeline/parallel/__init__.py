"""Parallelism inside one stage (imports only ``topology``).

* ``tensor_parallel`` - layers split over the processes of their stage: the model's plan or the built-in ones.
* ``data_parallel`` - replicas of a stage: DDP, or FSDP2 / replicate units; sharded layers' migration.
* ``dtensors`` - values of layers held as DTensors: pickled as their parts, gathered whole, laid out like another.
* ``compiled`` - layers compiled in place (``strategy.compile``), eager again while they migrate.
"""
