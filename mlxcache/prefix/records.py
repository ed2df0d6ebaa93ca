"""PrefixCache records: per-block KV slices, whole-prefix checkpoints and extras.

A prompt cache is a list of layers. Layers whose state is a plain token sequence (KVCache and
its kin: their adapter is ``per_block``, tag ``b:``) are cut into blocks: a block record holds
only that block's keys/values. Window layers (RotatingKVCache, ChunkedKVCache: their adapter
has a ``window``, tag ``w:``) are stored per block too, each block sliced from what the state
still holds (a block whose positions the layer dropped is written without them, listed
absent; prefix/gaps.py marks it for a later store to complete), and rebuilt at any
boundary from the positions they need there (serializers/windows.py). Every other layer
(ArraysCache, BufferedRotatingKVCache, ...) is a *checkpoint* layer (``c:``): its whole state
goes, through the prompt-cache serializer, into the tail record of one stored length. The
treatment is decided by class, never by state, so every block record of a model has the same
layout. Records written before window layers existed name them ``c:``: their layout differs,
so they never mix with new ones (a miss at a block boundary, a hit at their stored lengths).
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
from mlxcache.serializers.windows import Held


class RecordMismatch(ValueError):
    """A stored record does not belong where it was found (a miss, never served)."""


def layer_tag(layer: Any) -> str:
    """``"b:mlx_vlm.KVCache"`` for a block layer, ``"w:mlx_lm.RotatingKVCache"`` for a window
    layer, ``"c:<module>.<Class>"`` for a checkpoint."""
    found = adapters.find(layer)
    if found is not None and (found[1].per_block or found[1].window is not None):
        lib, name = found[0]
        return f"{'b' if found[1].per_block else 'w'}:{lib}.{name}"
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


def _stored_per_block(tag: str) -> bool:
    return tag.startswith(("b:", "w:"))


def window_views(prompt_cache: Sequence[Any], lay: list[str]) -> dict[int, Held]:
    """What each window layer still holds ({layer index: Held}), read once per store and
    evaluated (a rotated layer's temporal order is one copy, not one per block)."""
    views = {
        j: adapters.window_held(c)
        for j, (c, tag) in enumerate(zip(prompt_cache, lay, strict=True))
        if tag.startswith("w:")
    }
    mx.eval([a for h in views.values() for a in (h.keys, h.values) if a is not None])
    return views


def _parts(x: Any) -> tuple[mx.array, ...]:
    return tuple(x) if isinstance(x, tuple | list) else (x,)


def block_record(
    prompt_cache: Sequence[Any],
    lay: list[str],
    start: int,
    tokens: bytes,
    n: int,
    quant: KVQuant | None = None,
    views: dict[int, Held] | None = None,
) -> Record:
    """The block ``[start, start + n)`` of every block and window layer, as new (sliced) arrays.

    A window layer that no longer holds all of the block (it dropped old tokens) is written as
    zeros and listed in ``meta["absent"]``: never read, but every block of a model keeps one
    tensor table (file:// joins them), and the other layers' slices are still stored.

    Reads each layer through the serializer's adapter; ``params`` keeps the state's other
    fields (e.g. QuantizedKVCache's group_size and bits, a window's size) to rebuild the layer
    with. ``views`` are :func:`window_views` (read here when not given). With
    ``quant`` each plain key/value array is stored quantized (``meta["kvq"]`` says how); a
    QuantizedKVCache's parts are stored as they are.
    """
    if views is None:
        views = window_views(prompt_cache, lay)
    arrays: dict[str, mx.array] = {}
    params: list[Any] = []
    absent = []
    for j, (c, tag) in enumerate(zip(prompt_cache, lay, strict=True)):
        if tag.startswith("w:"):
            held = views[j]
            got = held.take(start, start + n)
            if got is None:
                absent.append(j)
                got = held.zeros(n)
            arrays[f"{j}.k0"], arrays[f"{j}.v0"] = got
            params.append(held.params)
            continue
        if not tag.startswith("b:"):
            params.append(None)
            continue
        keys, values, _, layer_params = adapters.block_state(c)
        params.append(layer_params)
        for side, x in (("k", keys), ("v", values)):
            for p, part in enumerate(_parts(x)):
                arrays[f"{j}.{side}{p}"] = part[..., start : start + n, :]
    meta = {"kind": "block", "start": start, "tokens": tokens, "layout": lay, "params": params}
    if views:
        meta["absent"] = absent
    if quant is not None:
        arrays, meta["kvq"] = kv_quant.quantize(arrays, quant)
    return Record(arrays=arrays, meta=meta)


def _layout_of(m: Mapping[str, Any]) -> list[str]:
    lay = m.get("layout")
    if not isinstance(lay, list) or not all(isinstance(t, str) for t in lay):
        raise RecordMismatch("record has no layout")
    return lay


def _head(m: Mapping[str, Any], want: dict[str, Any], lay: list[str] | None, of: str) -> list[str]:
    """The checks a block and a tail share: its kind, position and tokens are the request's,
    and its layout is that of ``of`` (``lay``, when known); returns its layout."""
    kind = want["kind"]
    if any(m.get(k) != v for k, v in want.items()):
        raise RecordMismatch(f"{kind} {' or '.join(list(want)[1:])} differ from the request")
    own = _layout_of(m)
    if lay is not None and own != lay:
        raise RecordMismatch(f"{kind} layout differs from {of}")
    return own


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
    own = _head(m, {"kind": "block", "start": start, "tokens": tokens}, lay, "the earlier blocks")
    params = m.get("params")
    if not isinstance(params, list) or len(params) != len(own):
        raise RecordMismatch("block params do not match its layout")
    for tag, p in zip(own, params, strict=True):
        if not (isinstance(p, dict) if _stored_per_block(tag) else p is None):
            raise RecordMismatch("block params do not match its layout")
    _check_windows(m.get("absent"), own, "block")
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


def _check_windows(listed: Any, lay: list[str], what: str) -> None:
    """A ``meta["absent"]`` / ``meta["windows"]`` list: window layers of ``lay``, each once;
    none in a layout without window layers (records from before window layers)."""
    windows = [j for j, t in enumerate(lay) if t.startswith("w:")]
    if not windows and listed is None:
        return
    ok = isinstance(listed, list) and all(type(j) is int and j in windows for j in listed)
    if not ok or len(set(listed)) != len(listed):
        raise RecordMismatch(f"{what} window list does not match its layout")


def _windows(meta: Mapping[str, Any], field: str) -> set[int]:
    return set(meta.get(field) or ())


def _gap(blocks: Sequence[Record | Placed], j: int, need: list[tuple[int, int]]) -> bool:
    """Whether window layer ``j`` is absent from a block holding a position in ``need``."""
    for b in blocks:
        s = b.meta["start"]
        e = s + len(b.meta["tokens"]) // 8
        if j in _windows(b.meta, "absent") and any(s < hi and lo < e for lo, hi in need):
            return True
    return False


def _need(tag: str, params: Any, n: int) -> list[tuple[int, int]]:
    lib, _, name = tag[2:].partition(".")
    if not isinstance(params, dict):
        raise RecordMismatch("window params are not a dict")
    return adapters.window_need(lib, name, params, n)


def window_needs(
    views: dict[int, Held], lay: list[str], n: int
) -> dict[int, list[tuple[int, int]]]:
    """The positions each window layer needs at ``n`` ({layer index: ranges})."""
    return {j: _need(lay[j], h.params, n) for j, h in views.items()}


def window_gaps(
    written: Sequence[Record],
    views: dict[int, Held],
    lay: list[str],
    n: int,
    marked: Sequence[tuple[int, int]] = (),
) -> list[int]:
    """Window layers that a tail at ``n`` must carry whole: a block this store writes without
    them, or a stored block marked as lacking some window layer (``marked``: its span; which
    layers it lacks is not read, so every one it holds a needed position of), holds positions
    they need at ``n`` (their older tokens were dropped)."""
    out = []
    for j, need in window_needs(views, lay, n).items():
        if _gap(written, j, need) or any(s < hi and lo < e for s, e in marked for lo, hi in need):
            out.append(j)
    return sorted(out)


def windows_held(blocks: Sequence[Record | Placed], lay: list[str], tail: Record | None) -> bool:
    """Whether ``blocks`` (consecutive, from 0) and ``tail`` rebuild every window layer."""
    if not blocks:
        return True
    n = sum(len(b.meta["tokens"]) // 8 for b in blocks)
    whole = _windows(tail.meta, "windows") if tail is not None else set()
    params = blocks[0].meta["params"]
    for j, tag in enumerate(lay):
        if tag.startswith("w:") and j not in whole and _gap(blocks, j, _need(tag, params[j], n)):
            return False
    return True


def join_blocks(
    blocks: Sequence[Record | Placed],
    lay: list[str],
    quant: KVQuant | None = None,
    skip: set[int] | frozenset[int] = frozenset(),
) -> dict[int, Any]:
    """Rebuild every block and window layer from consecutive verified blocks: {layer index:
    cache}; a window layer from the positions it needs at the blocks' end.

    Placed blocks (the leading records of one ``Joined``) are in their final arrays already;
    Records are concatenated.
    ``quant`` is the reader's setting: a block stored otherwise raises (a miss); quantized
    arrays are joined, then dequantized once to their original dtype. Window layers in
    ``skip`` come from the tail; any other must be held by every block it needs (else raises).
    """
    params = blocks[0].meta["params"]
    n = sum(len(b.meta["tokens"]) // 8 for b in blocks)
    if isinstance(blocks[0], Placed):  # read into joined arrays already (file://)
        joined = blocks[0].join.arrays(len(blocks))
    else:
        recs = [b for b in blocks if isinstance(b, Record)]
        joined = {k: mx.concatenate([b.arrays[k] for b in recs], axis=-2) for k in recs[0].arrays}
    joined = kv_quant.restore(joined, blocks[0].meta.get("kvq"), quant)
    sided: dict[tuple[str, str], list[str]] = {}  # (layer, side) -> its array names, one pass
    for k in joined:
        layer, dot, rest = k.partition(".")
        if dot and rest:
            sided.setdefault((layer, rest[0]), []).append(k)
    out: dict[int, Any] = {}
    for j, tag in enumerate(lay):
        lib, _, name = tag[2:].partition(".")
        if tag.startswith("w:"):
            if j not in skip:
                if _gap(blocks, j, _need(tag, params[j], n)):
                    raise RecordMismatch("a window layer is absent from a block it needs")
                out[j] = _join_window(joined, j, lib, name, params[j], n)
            continue
        if not tag.startswith("b:"):
            continue
        sides = []
        for side in ("k", "v"):
            names = sorted(sided.get((str(j), side), ()))  # those starting f"{j}.{side}"
            parts = tuple(joined[k] for k in names)
            sides.append(parts if len(parts) > 1 else parts[0])
        out[j] = adapters.from_block_state(lib, name, sides[0], sides[1], n, params[j])
    return out


def _join_window(
    joined: dict[str, mx.array], j: int, lib: str, name: str, params: Any, n: int
) -> Any:
    """A window layer of ``n`` tokens from its joined rows: the ranges it needs, copied out."""
    if not isinstance(params, dict) or f"{j}.k0" not in joined or f"{j}.v0" not in joined:
        raise RecordMismatch("window layer arrays missing from the blocks")
    need = adapters.window_need(lib, name, params, n)
    sides = []
    for side in ("k", "v"):
        x = joined[f"{j}.{side}0"]
        parts = [x[..., a:b, :] for a, b in need]
        sides.append(mx.concatenate(parts, axis=-2) if len(parts) > 1 else mx.contiguous(parts[0]))
    return adapters.from_window(lib, name, params, sides[0], sides[1], n)


def tail_record(
    prompt_cache: Sequence[Any],
    lay: list[str],
    length: int,
    tokens: bytes,
    extras: Mapping[str, Any] | None,
    windows: Sequence[int] = (),
) -> Record:
    """What one stored length needs besides its blocks: checkpoint layers and extras.

    ``windows`` (from :func:`window_gaps`) are window layers stored whole here too, because
    some block they need was written without them.
    """
    arrays: dict[str, mx.array] = {}
    ckpt_meta = None
    idx = _tail_layers(lay, windows)
    ckpt = [prompt_cache[j] for j in idx]
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
    if any(t.startswith("w:") for t in lay):
        meta["windows"] = sorted(windows)
    return Record(arrays=arrays, meta=meta)


def tail_windows(tail: Record | None) -> set[int]:
    """The window layers a (verified) tail holds whole."""
    return _windows(tail.meta, "windows") if tail is not None else set()


def _tail_layers(lay: list[str], windows: Sequence[int] | set[int]) -> list[int]:
    """The layers a tail stores whole: checkpoint layers and the listed window layers."""
    return [
        j for j, t in enumerate(lay) if t.startswith("c:") or (t.startswith("w:") and j in windows)
    ]


def check_tail(rec: Record, length: int, tokens: bytes, lay: list[str] | None) -> list[str]:
    m = rec.meta
    own = _head(m, {"kind": "tail", "length": length, "tokens": tokens}, lay, "its blocks")
    names = m.get("extras")
    if not isinstance(names, list) or not all(isinstance(x, str) for x in names):
        raise RecordMismatch("tail extras are not a list of names")
    _check_windows(m.get("windows"), own, "tail")
    ckpt = m.get("ckpt")
    if not (isinstance(ckpt, dict) if _tail_layers(own, _windows(m, "windows")) else ckpt is None):
        raise RecordMismatch("tail checkpoint does not match its layout")
    return list(own)


def read_tail(rec: Record, lay: list[str]) -> tuple[dict[int, Any], dict[str, mx.array]]:
    """Checkpoint layers ({layer index: cache}) and extras of a verified tail record."""
    extras = {name: rec.arrays[f"x.{name}"] for name in rec.meta["extras"]}
    idx = _tail_layers(lay, _windows(rec.meta, "windows"))
    if not idx:
        return {}, extras
    arrays = {k[2:]: v for k, v in rec.arrays.items() if k.startswith("c.")}
    layers = load_prompt_cache(Record(arrays=arrays, meta=rec.meta["ckpt"]))
    for c, j in zip(layers, idx, strict=True):
        # a window layer in a tail from before window layers was a checkpoint ("c:")
        if lay[j] not in (layer_tag(c), f"c:{type(c).__module__}.{type(c).__name__}"):
            raise RecordMismatch("checkpoint layers differ from the layout")
    return dict(zip(idx, layers, strict=True)), extras
