"""Opt-in lossy KV storage: per-block keys/values quantized with ``mx.quantize`` (affine).

Fewer bytes moved to Redis or disk (8-bit: ~1.9x fewer than bf16, 4-bit: ~3.6x, group 64)
for a bounded error: each value comes back within one quantization step of its group
(``|scale|``) plus the rounding of its dtype. An array whose last axis is not a multiple of
the group size, or that is not floating point, is kept exact. See docs/prefix.md.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

log = logging.getLogger("mlxcache")

BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize's affine mode takes, minus 1 bit (no KV survives)
GROUP_SIZES = (32, 64, 128)  # what mx.quantize takes (0 kills the process, so we check first)
PARTS = ("w", "s", "b")  # packed uint32 weights, scales, biases: "<name>.qw", ".qs", ".qb"
_SUFFIXES = tuple(f".q{p}" for p in PARTS)
_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
_NAMES = {d: n for n, d in _DTYPES.items()}
_UNIT = {mx.float32: 2.0**-24, mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8}  # unit roundoff
_warned: set[tuple[int, int]] = set()


class QuantError(ValueError):
    """A quantized record does not match its marker or the reader's setting (a miss)."""


@dataclass(frozen=True)
class KVQuant:
    """How block KV is stored: ``bits`` per value, one scale and bias per ``group_size``."""

    bits: int
    group_size: int = 64

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("kv_bits", self.bits, BITS),
            ("kv_group_size", self.group_size, GROUP_SIZES),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value not in allowed:
                raise ValueError(
                    f"{name} must be one of {', '.join(map(str, allowed))}, got {value!r}"
                )

    @property
    def tag(self) -> str:
        """The namespace part (``hashing.namespace_seed(kv=...)``): settings never mix."""
        return f"affine-q{self.bits}-g{self.group_size}"

    def fits(self, a: mx.array) -> bool:
        """Whether ``a`` is quantized (floating, 2-D or more, last axis whole groups)."""
        return (
            a.dtype in _NAMES and a.ndim >= 2 and a.size > 0 and a.shape[-1] % self.group_size == 0
        )


def make(bits: int | None, group_size: int = 64) -> KVQuant | None:
    """The setting of ``PrefixCache(kv_bits=..., kv_group_size=...)``; None = exact storage."""
    if bits is None:
        KVQuant(8, group_size)  # a bad group size is an error even while off
        return None
    return KVQuant(bits, group_size)


def quantize(arrays: Mapping[str, mx.array], q: KVQuant) -> tuple[dict[str, mx.array], dict]:
    """Arrays with each fitting one replaced by its three parts, and the record's marker.

    The marker (``meta["kvq"]``) names the setting and, per quantized array, its dtype and
    last-axis size; arrays not in it are stored exact.
    """
    out: dict[str, mx.array] = {}
    done: dict[str, dict[str, Any]] = {}
    for name, a in arrays.items():
        if not q.fits(a):
            if isinstance(a, mx.array) and (a.shape[-1], q.group_size) not in _warned:
                _warned.add((a.shape[-1], q.group_size))
                log.warning(
                    "kv quantization: arrays of last axis %d (%s) are not whole groups of %d: "
                    "stored exact",
                    a.shape[-1],
                    a.dtype,
                    q.group_size,
                )
            out[name] = a
            continue
        parts = mx.quantize(a, group_size=q.group_size, bits=q.bits)
        for p, x in zip(PARTS, parts, strict=True):
            out[f"{name}.q{p}"] = x
        done[name] = {"dtype": _NAMES[a.dtype], "dim": int(a.shape[-1])}
    return out, {"mode": "affine", "bits": q.bits, "group_size": q.group_size, "arrays": done}


def restore(arrays: Mapping[str, mx.array], marker: Any, q: KVQuant | None) -> dict[str, mx.array]:
    """The original arrays (dequantized to their dtype) of what :func:`quantize` made.

    Raises QuantError when the record's marker is not the reader's setting (an exact reader
    never takes a quantized record, nor a reader of other bits or groups) or does not fit the
    arrays.
    """
    if q is None:
        if marker is not None:
            raise QuantError("a quantized record found by an exact reader")
        return dict(arrays)
    want = {"mode": "affine", "bits": q.bits, "group_size": q.group_size}
    if not isinstance(marker, dict) or {k: marker.get(k) for k in want} != want:
        raise QuantError(f"record quantization {marker!r:.80} is not the reader's {q.tag}")
    done = marker.get("arrays")
    if not isinstance(done, dict):
        raise QuantError("quantization marker lists no arrays")
    out = {k: a for k, a in arrays.items() if not k.endswith(_SUFFIXES)}
    if len(out) + 3 * len(done) != len(arrays):
        raise QuantError("quantized parts do not match the marker")
    for name, info in done.items():
        dtype = _DTYPES.get(info.get("dtype", "")) if isinstance(info, dict) else None
        try:
            w, s, b = (arrays[f"{name}.q{p}"] for p in PARTS)
        except (KeyError, TypeError):
            raise QuantError(f"quantized array {name!r:.80} is missing a part") from None
        if dtype is None or w.dtype != mx.uint32 or s.dtype != dtype or b.dtype != dtype:
            raise QuantError(f"quantized array {name!r:.80} has the wrong dtypes")
        dim = info.get("dim")
        if (
            not isinstance(dim, int)
            or dim % q.group_size
            or w.shape[:-1] != s.shape[:-1]
            or s.shape != b.shape
            or w.shape[-1] * 32 != dim * q.bits
            or s.shape[-1] * q.group_size != dim
        ):
            raise QuantError(f"quantized array {name!r:.80} does not fit its marker")
        x = dequantize(w, s, b, q)
        out[name] = x if x.dtype == dtype else x.astype(dtype)
    return out


def dequantize(w: mx.array, scales: mx.array, biases: mx.array, q: KVQuant) -> mx.array:
    """``mx.dequantize``, bit for bit; on the CPU, 2/4/8 bits unpack with plain array ops.

    MLX's CPU dequantize ran at 0.1-0.3 GB/s here (bf16); the unpack below (bytes, nibbles or
    crumbs, then ``q * scale + bias`` in the same dtype and order) ran 2-4x faster.
    """
    if q.bits not in (2, 4, 8) or mx.default_device() != mx.cpu:
        return mx.dequantize(w, scales, biases, group_size=q.group_size, bits=q.bits)
    u = w.view(mx.uint8)  # element i sits at bit (i * bits) % 8 of byte i * bits // 8
    if q.bits < 8:
        mask = (1 << q.bits) - 1
        u = mx.stack([(u >> shift) & mask for shift in range(0, 8, q.bits)], axis=-1)
    lead, groups = w.shape[:-1], scales.shape[-1]
    u = u.reshape(*lead, groups, q.group_size).astype(scales.dtype)
    return (u * scales[..., None] + biases[..., None]).reshape(*lead, groups * q.group_size)


def error_bound(original: mx.array, scales: mx.array, q: KVQuant) -> mx.array:
    """Per-group bound on ``|dequantized - original|``: one step (``|scale|``; mx.quantize
    snaps zero to the grid, so an edge value can be a whole step off) plus 4 units of the
    dtype's rounding of the group's largest value (output, scale and bias rounding)."""
    unit = _UNIT[original.dtype]
    g = original.astype(mx.float32).reshape(*original.shape[:-1], -1, q.group_size)
    return mx.abs(scales.astype(mx.float32)) + 4 * unit * mx.abs(g).max(axis=-1)
