"""PrefixCache records: per-block KV slices, whole-prefix checkpoints and extras.

A prompt cache is a list of layers. Layers whose state is a plain token sequence (KVCache and
its kin: their adapter is ``per_block``) are cut into blocks: a block record holds only that block's
keys/values. Every other layer (RotatingKVCache, ArraysCache, ChunkedKVCache, ...) is a
*checkpoint* layer: its whole state goes, through the prompt-cache serializer, into the tail
record of one stored length. The treatment is decided by class, never by state, so every block
record of a model has the same layout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx

from mlxcache.records.gather import Placed
from mlxcache.records.record import Record
from mlxcache.serializers import adapters, kv_quant
from mlxcache.serializers.kv_quant import KVQuant
from mlxcache.serializers.prompt_cache import dump_prompt_cache, load_prompt_cache


class RecordMismatch(ValueError):
    """A stored record does not belong where it was found (a miss, never served)."""


def layer_tag(layer: Any) -> str:
    """``"b:mlx_vlm.KVCache"`` for a block layer, ``"c:<module>.<Class>"`` for a checkpoint."""
    found = adapters.find(layer)
    if found is not None and found[1].per_block:
        lib, name = found[0]
        return f"b:{lib}.{name}"
    cls = type(layer)
    return f"c:{cls.__module__}.{cls.__name__}"


def layout(prompt_cache: Sequence[Any]) -> list[str]:
    return [layer_tag(c) for c in prompt_cache]


def has_checkpoint(lay: Sequence[str]) -> bool:
    return any(t.startswith("c:") for t in lay)


def check_lengths(prompt_cache: Sequence[Any], num_tokens: int) -> None:
    """Every layer that counts its tokens must hold exactly ``num_tokens`` of them."""
    for i, c in enumerate(prompt_cache):
        n: object
        if layer_tag(c).startswith("b:"):
            n = adapters.block_state(c)[2]
        else:
            n = getattr(c, "offset", None)
            if not isinstance(n, int) or isinstance(n, bool):
                continue  # state caches (ArraysCache...) do not count tokens
        if n != num_tokens:
            raise ValueError(
                f"prompt_cache[{i}] ({type(c).__name__}) holds {n} tokens but token_ids has "
                f"{num_tokens}: store the cache of exactly these tokens"
            )


def _parts(x: Any) -> tuple[mx.array, ...]:
    return tuple(x) if isinstance(x, tuple | list) else (x,)


def block_record(
    prompt_cache: Sequence[Any],
    lay: list[str],
    start: int,
    tokens: bytes,
    n: int,
    quant: KVQuant | None = None,
) -> Record:
    """The block ``[start, start + n)`` of every block layer, as new (sliced) arrays.

    Reads each layer through the serializer's adapter; ``params`` keeps the state's other
    fields (e.g. QuantizedKVCache's group_size and bits) to rebuild the layer with. With
    ``quant`` each plain key/value array is stored quantized (``meta["kvq"]`` says how); a
    QuantizedKVCache's parts are stored as they are.
    """
    arrays: dict[str, mx.array] = {}
    params: list[Any] = []
    for j, (c, tag) in enumerate(zip(prompt_cache, lay, strict=True)):
        if not tag.startswith("b:"):
            params.append(None)
            continue
        keys, values, _, layer_params = adapters.block_state(c)
        params.append(layer_params)
        for side, x in (("k", keys), ("v", values)):
            for p, part in enumerate(_parts(x)):
                arrays[f"{j}.{side}{p}"] = part[..., start : start + n, :]
    meta = {"kind": "block", "start": start, "tokens": tokens, "layout": lay, "params": params}
    if quant is not None:
        arrays, meta["kvq"] = kv_quant.quantize(arrays, quant)
    return Record(arrays=arrays, meta=meta)


def _layout_of(m: Mapping[str, Any]) -> list[str]:
    lay = m.get("layout")
    if not isinstance(lay, list) or not all(isinstance(t, str) for t in lay):
        raise RecordMismatch("record has no layout")
    return lay


def check_block(
    rec: Record | Placed,
    start: int,
    tokens: bytes,
    lay: list[str] | None,
    like: Record | Placed | None,
) -> list[str]:
    """Verify a fetched block record against the request; returns its layout.

    Also checks the record's own shape (layout, one params entry per layer), so a record of
    another format or a forged one is a mismatch here, never an exception when restoring.
    """
    m = rec.meta
    if m.get("kind") != "block" or m.get("start") != start or m.get("tokens") != tokens:
        raise RecordMismatch("block start or tokens differ from the request")
    own = _layout_of(m)
    if lay is not None and own != lay:
        raise RecordMismatch("block layout differs from the earlier blocks")
    params = m.get("params")
    if not isinstance(params, list) or len(params) != len(own):
        raise RecordMismatch("block params do not match its layout")
    for tag, p in zip(own, params, strict=True):
        if not (isinstance(p, dict) if tag.startswith("b:") else p is None):
            raise RecordMismatch("block params do not match its layout")
    n = len(tokens) // 8
    for name, a in rec.arrays.items():
        if a.ndim < 2 or a.shape[-2] != n:
            raise RecordMismatch(f"block array {name!r} does not hold {n} tokens")
    if like is not None:
        same = like.meta.get("params") == m.get("params") and like.meta.get("kvq") == m.get("kvq")
        if not same or set(like.arrays) != set(rec.arrays):
            raise RecordMismatch("block arrays differ from the earlier blocks")
        for name, a in rec.arrays.items():
            b = like.arrays[name]
            if a.dtype != b.dtype or a.shape[:-2] != b.shape[:-2] or a.shape[-1] != b.shape[-1]:
                raise RecordMismatch(f"block array {name!r} has another shape or dtype")
    return list(own)


def join_blocks(
    blocks: Sequence[Record | Placed], lay: list[str], quant: KVQuant | None = None
) -> dict[int, Any]:
    """Rebuild every block layer from consecutive verified blocks: {layer index: cache}.

    Placed blocks (the leading records of one ``Joined``) are in their final arrays already;
    Records are concatenated.
    ``quant`` is the reader's setting: a block stored otherwise raises (a miss); quantized
    arrays are joined, then dequantized once to their original dtype.
    """
    params = blocks[0].meta["params"]
    n = sum(len(b.meta["tokens"]) // 8 for b in blocks)
    if isinstance(blocks[0], Placed):  # read into joined arrays already (file://)
        joined = blocks[0].join.arrays(len(blocks))
    else:
        recs = [b for b in blocks if isinstance(b, Record)]
        joined = {k: mx.concatenate([b.arrays[k] for b in recs], axis=-2) for k in recs[0].arrays}
    joined = kv_quant.restore(joined, blocks[0].meta.get("kvq"), quant)
    out: dict[int, Any] = {}
    for j, tag in enumerate(lay):
        if not tag.startswith("b:"):
            continue
        lib, _, name = tag[2:].partition(".")
        sides = []
        for side in ("k", "v"):
            names = sorted(k for k in joined if k.startswith(f"{j}.{side}"))
            parts = tuple(joined[k] for k in names)
            sides.append(parts if len(parts) > 1 else parts[0])
        out[j] = adapters.from_block_state(lib, name, sides[0], sides[1], n, params[j])
    return out


def tail_record(
    prompt_cache: Sequence[Any],
    lay: list[str],
    length: int,
    tokens: bytes,
    extras: Mapping[str, Any] | None,
) -> Record:
    """What one stored length needs besides its blocks: checkpoint layers and extras."""
    arrays: dict[str, mx.array] = {}
    ckpt_meta = None
    ckpt = [c for c, tag in zip(prompt_cache, lay, strict=True) if tag.startswith("c:")]
    if ckpt:
        rec = dump_prompt_cache(ckpt)
        arrays.update({f"c.{k}": v for k, v in rec.arrays.items()})
        ckpt_meta = dict(rec.meta)
    names = []
    for name, value in (extras or {}).items():
        if not isinstance(name, str):
            raise TypeError(f"extras keys must be str, got {name!r}")
        arrays[f"x.{name}"] = value if isinstance(value, mx.array) else mx.array(value)
        names.append(name)
    meta = {
        "kind": "tail",
        "length": length,
        "tokens": tokens,
        "layout": lay,
        "ckpt": ckpt_meta,
        "extras": names,
    }
    return Record(arrays=arrays, meta=meta)


def check_tail(rec: Record, length: int, tokens: bytes, lay: list[str] | None) -> list[str]:
    m = rec.meta
    if m.get("kind") != "tail" or m.get("length") != length or m.get("tokens") != tokens:
        raise RecordMismatch("tail length or tokens differ from the request")
    own = _layout_of(m)
    if lay is not None and own != lay:
        raise RecordMismatch("tail layout differs from its blocks")
    names = m.get("extras")
    if not isinstance(names, list) or not all(isinstance(x, str) for x in names):
        raise RecordMismatch("tail extras are not a list of names")
    ckpt = m.get("ckpt")
    if not (isinstance(ckpt, dict) if has_checkpoint(own) else ckpt is None):
        raise RecordMismatch("tail checkpoint does not match its layout")
    return list(own)


def read_tail(rec: Record, lay: list[str]) -> tuple[dict[int, Any], dict[str, mx.array]]:
    """Checkpoint layers ({layer index: cache}) and extras of a verified tail record."""
    extras = {name: rec.arrays[f"x.{name}"] for name in rec.meta["extras"]}
    idx = [j for j, tag in enumerate(lay) if tag.startswith("c:")]
    if not idx:
        return {}, extras
    arrays = {k[2:]: v for k, v in rec.arrays.items() if k.startswith("c.")}
    layers = load_prompt_cache(Record(arrays=arrays, meta=rec.meta["ckpt"]))
    if [layer_tag(c) for c in layers] != [lay[j] for j in idx]:
        raise RecordMismatch("checkpoint layers differ from the layout")
    return dict(zip(idx, layers, strict=True)), extras
