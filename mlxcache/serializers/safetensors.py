"""Old import path of the record format: :mod:`mlxcache.format` and :mod:`mlxcache.format_read`."""

from mlxcache.format import *  # noqa: F403
from mlxcache.format import __all__ as _format_all
from mlxcache.format_read import read_file, read_header

__all__ = [*_format_all, "read_file", "read_header"]
