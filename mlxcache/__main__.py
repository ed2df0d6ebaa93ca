"""``python -m mlxcache`` runs the command line."""

import sys

from mlxcache.cli.app import main

sys.exit(main())
