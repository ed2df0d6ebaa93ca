"""The ``mlxcache`` command line: ``app`` (parser and dispatch), ``common`` (opening a store,
telling failure from a miss), ``store`` and ``lifetimes`` (subcommands), ``warm``, the demos and
``progress``. The top layer: it may import every other part, and nothing imports it.
"""

from mlxcache.cli.app import main

__all__ = ["main"]
