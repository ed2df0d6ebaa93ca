"""``vllm_mlx.mllm_cache``'s import path: see :mod:`mlxcache.integrations.vllm_mlx.mllm_cache`.

vllm-mlx users change ``from vllm_mlx.mllm_cache import ...`` to ``from mlxcache.mllm_cache
import ...``; the module lives with the other vllm-mlx compatible pieces.
"""

from mlxcache.integrations.vllm_mlx.mllm_cache import *  # noqa: F403
from mlxcache.integrations.vllm_mlx.mllm_cache import ENTRY_PREFIX, INDEX_PREFIX, __all__  # noqa: F401
