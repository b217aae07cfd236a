"""The ``shardkit`` command: its subcommands (``commands``), the training run they start (``run``,
its inputs, log, directory and progress), saved runs, and the generated error catalogue.

May import: ``core``, ``runtime``, ``io``, ``parallel``, ``models``, ``analysis``, ``training``, ``plan``.
"""
