"""Integrations of mlxcache with inference libraries (``mlxcache.integrations.mlx_vlm``)."""
