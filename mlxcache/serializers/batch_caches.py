"""Adapters of the batched cache classes (``Batch*``): per-row offsets and paddings are arrays."""

from __future__ import annotations

from typing import Any

from mlxcache.serializers.states import (
    Adapter,
    array_field,
    check,
    int_field,
    kv_fields,
    no_speculation,
    seq,
    seq_len,
)

# ---------------------------------------------------------------- batched caches


def _dump_batch_kv(c: Any) -> dict[str, Any]:
    n = int(c._idx)
    return {
        "keys": seq(c.keys, n),
        "values": seq(c.values, n),
        "idx": n,
        "offset": c.offset,
        "left_padding": c.left_padding,
        "right_padding": getattr(c, "_right_padding", None),
    }


def _set_batch(c: Any, s: dict[str, Any], quantized: bool = False) -> Any:
    c.keys, c.values = kv_fields(s, quantized)
    c._idx = int_field(s, "idx")
    c.offset = array_field(s, "offset", optional=False)
    c.left_padding = array_field(s, "left_padding", optional=False)
    c._right_padding = array_field(s, "right_padding")
    return c


BATCH_KV = Adapter(_dump_batch_kv, lambda cls, s: _set_batch(cls([]), s))


def _dump_batch_quant(c: Any) -> dict[str, Any]:
    s = _dump_batch_kv(c)
    s.update(group_size=int(c.group_size), bits=int(c.bits))
    return s


def _load_batch_quant(cls: type, s: dict[str, Any]) -> Any:
    c = cls([], group_size=int_field(s, "group_size"), bits=int_field(s, "bits"))
    return _set_batch(c, s, quantized=True)


BATCH_QUANT = Adapter(_dump_batch_quant, _load_batch_quant)


def _dump_batch_rotating(c: Any) -> dict[str, Any]:
    n = min(int(c._offset), seq_len(c.keys)) if c.keys is not None else 0
    return {
        "keys": seq(c.keys, n),
        "values": seq(c.values, n),
        "offset": c.offset,
        "left_padding": c.left_padding,
        "lengths": c._lengths,
        "max_size": int(c.max_size),
        "token_offset": int(c._offset),
        "idx": int(c._idx),
        "rotated": bool(c.rotated),
    }


def _load_batch_rotating(cls: type, s: dict[str, Any]) -> Any:
    c = cls(int_field(s, "max_size"), [])
    c.keys, c.values = kv_fields(s)
    c.offset = array_field(s, "offset", optional=False)
    c.left_padding = array_field(s, "left_padding", optional=False)
    c._lengths = array_field(s, "lengths")
    c._offset, c._idx = int_field(s, "token_offset"), int_field(s, "idx")
    check(isinstance(s["rotated"], bool), "rotated must be a bool")
    c.rotated = s["rotated"]
    return c


BATCH_ROTATING = Adapter(_dump_batch_rotating, _load_batch_rotating)

_POOL_LISTS = ("left_padding", "remainder", "_pool_lengths", "_lengths", "_processed")


def _dump_batch_pooling(c: Any) -> dict[str, Any]:
    no_speculation(c)
    s = {"ratio": int(c.ratio), "buf_kv": c.buf_kv, "buf_gate": c.buf_gate, "pooled": c.pooled}
    s.update({name.lstrip("_"): [int(x) for x in getattr(c, name)] for name in _POOL_LISTS})
    return s


def _load_batch_pooling(cls: type, s: dict[str, Any]) -> Any:
    c = cls(int_field(s, "ratio"), [])
    for name in _POOL_LISTS:
        v = s[name.lstrip("_")]
        check(isinstance(v, list) and all(isinstance(x, int) for x in v), f"bad {name}")
        setattr(c, name, list(v))
    c.buf_kv, c.buf_gate, c.pooled = (array_field(s, n) for n in ("buf_kv", "buf_gate", "pooled"))
    return c


BATCH_POOLING = Adapter(_dump_batch_pooling, _load_batch_pooling)


# ---------------------------------------------------------------- the allowlist
