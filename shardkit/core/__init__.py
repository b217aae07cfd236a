"""The core: what a layout is and where every array lives, before anything compiles.

Errors (the ``ShardkitError`` family), command-line flags and configs, the mesh and its
``Layout``, logical-axis ``Rules`` and the one resolver, annotations to ``PartitionSpec``
(``partition``), the ``ShardingPlan``, the ``TrainState``, precision policies and the checks
on batches.

May import: nothing else of shardkit (JAX, Flax and optax only). Everything else builds on it.
"""
