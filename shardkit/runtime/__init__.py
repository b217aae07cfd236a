"""The process and its devices: simulated CPU devices, XLA's options, the host allocator,
``jax.distributed`` and the launcher of several processes, directory locks and the stop signal.

May import: ``core``.
"""
