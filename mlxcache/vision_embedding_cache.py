"""``vllm_mlx.vision_embedding_cache``'s import path: see
:mod:`mlxcache.integrations.vllm_mlx.vision_embedding_cache`."""

from mlxcache.integrations.vllm_mlx.vision_embedding_cache import *  # noqa: F403
from mlxcache.integrations.vllm_mlx.vision_embedding_cache import KEY_PREFIX, __all__  # noqa: F401
