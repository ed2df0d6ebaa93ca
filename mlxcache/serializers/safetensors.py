"""Old import path of the record format; the module is :mod:`mlxcache.format`."""

from mlxcache.format import *  # noqa: F403
from mlxcache.format import __all__  # noqa: F401
