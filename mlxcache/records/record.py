"""Record: the unit a backend stores, a dict of MLX arrays plus msgpack-able metadata."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlxcache.records import meta as meta_codec


@dataclass(frozen=True)
class Record:
    """Named tensors plus metadata; backends store it as one safetensors blob.

    ``arrays`` maps tensor names to ``mx.array``; ``meta`` holds msgpack-able values only
    (str, int, float, bool, None, bytes, lists and str-keyed dicts of those). Both are checked
    here, so a bad record fails before any backend writes a byte.
    """

    arrays: Mapping[str, mx.array] = field(default_factory=dict)
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.arrays, Mapping):
            raise TypeError(f"Record.arrays must be a dict, got {type(self.arrays).__name__}")
        for name, value in self.arrays.items():
            if not isinstance(name, str):
                raise TypeError(f"Record.arrays keys must be str, got {name!r}")
            if name == "__metadata__":  # the safetensors header's own entry
                raise ValueError("Record.arrays name '__metadata__' is reserved")
            if not isinstance(value, mx.array):
                raise TypeError(
                    f"Record.arrays[{name!r}] must be an mx.array, got {type(value).__name__}"
                )
        if not isinstance(self.meta, Mapping):
            raise TypeError(f"Record.meta must be a dict, got {type(self.meta).__name__}")
        for name in self.meta:
            if not isinstance(name, str):
                raise TypeError(f"Record.meta keys must be str, got {name!r}")
        meta_codec.pack(dict(self.meta))  # raises TypeError naming what msgpack cannot encode

    @property
    def nbytes(self) -> int:
        """Bytes held by the tensors (metadata is small and not counted)."""
        return sum(a.nbytes for a in self.arrays.values())
