"""Old import path of the metadata codec; the module is :mod:`mlxcache.meta`."""

from mlxcache.meta import pack, unpack  # noqa: F401
