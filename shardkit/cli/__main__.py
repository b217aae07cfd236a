"""``python -m shardkit.cli``: the ``shardkit`` command."""

from shardkit.cli.commands import main

raise SystemExit(main())
