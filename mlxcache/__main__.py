"""``python -m mlxcache`` runs the command line."""

import sys

from mlxcache.cli import main

sys.exit(main())
