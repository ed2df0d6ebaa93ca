"""mlx-vlm on mlxcache: cached prefill and generation (``generate``), what mlxcache knows about
model families (``models``) and a shared ``VisionFeatureCache`` (``vision``).

Importing this package loads only ``generate``; ``vision`` imports mlx-vlm's server.
"""

from mlxcache.integrations.mlx_vlm.generate import *  # noqa: F403
from mlxcache.integrations.mlx_vlm.generate import __all__  # noqa: F401
