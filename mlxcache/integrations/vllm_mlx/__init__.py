"""vllm-mlx compatible managers on any mlxcache backend.

``mllm_cache`` and ``vision_embedding_cache`` have the names, signatures, defaults, stats and
aliases of vllm-mlx's modules of the same names (also importable as ``mlxcache.mllm_cache`` and
``mlxcache.vision_embedding_cache``); ``entries`` is what both managers share, ``payloads``
turns their values into Records, ``keys`` holds vllm-mlx's image-hash helpers.

``install(backend=URI)`` / ``uninstall()`` (``seam.py``) put vllm-mlx 0.6's own server and
engines on the shared cache: ``shared_tier.py`` is the tier under vllm-mlx's
``MemoryAwarePrefixCache``, ``vision_seam.py`` its batched path's vision cache,
``simple_vlm.py`` its simple-mode VLM chat, ``usage.py`` reports cached prompt tokens and
``server.py`` is ``mlxcache serve --engine vllm-mlx``. Nothing here imports vllm-mlx until
``install()`` runs.
"""

from mlxcache.integrations.vllm_mlx.seam import check_version, install, installed, uninstall

__all__ = ["check_version", "install", "installed", "uninstall"]
