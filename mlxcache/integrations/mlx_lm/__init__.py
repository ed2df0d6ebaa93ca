"""mlx-lm on mlxcache: cached generation (``generate``), prompt-cache files (``files``), the
server's shared prompt cache (``prompt_cache``) and ``mlxcache serve`` (``server``).

Importing this package loads only ``generate``; the others import mlx-lm's server pieces.
"""

from mlxcache.integrations.mlx_lm.generate import *  # noqa: F403
from mlxcache.integrations.mlx_lm.generate import __all__  # noqa: F401
