"""Serializers: MLX cache objects <-> Record (Record <-> bytes is ``mlxcache.records.format``)."""

from mlxcache.serializers.prompt_cache import *  # noqa: F403
from mlxcache.serializers.prompt_cache import __all__  # noqa: F401
