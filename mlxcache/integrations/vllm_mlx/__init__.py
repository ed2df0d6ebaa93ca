"""vllm-mlx compatible managers on any mlxcache backend.

``mllm_cache`` and ``vision_embedding_cache`` have the names, signatures, defaults, stats and
aliases of vllm-mlx's modules of the same names (also importable as ``mlxcache.mllm_cache`` and
``mlxcache.vision_embedding_cache``); ``entries`` is what both managers share, ``payloads``
turns their values into Records, ``keys`` holds vllm-mlx's image-hash helpers.
"""
