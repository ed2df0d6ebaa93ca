"""file:// restores read block records straight into the final arrays (``get_joined``): still
bit-exact for every cache class, every byte verified, and no restore shares memory with another."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest
from cache_cases import ALL_CASES, build_case, record_bits, scalar_attrs
from helpers import bits

from mlxcache import PrefixCache
from mlxcache.backends.disk import DiskBackend
from mlxcache.prefix import records as pr
from mlxcache.records import reader
from mlxcache.records.signing import Signer
from mlxcache.serializers import adapters, dump_prompt_cache

BS = 4


def tokens_of(cache: list) -> int:
    """How many tokens a case's cache holds (what ``PrefixCache.store`` checks)."""
    for c in cache:
        if pr.layer_tag(c).startswith("b:"):
            return adapters.block_state(c)[2]
        n = getattr(c, "offset", None)
        if isinstance(n, int) and not isinstance(n, bool):
            return n
    return 5  # state caches (ArraysCache...) do not count tokens


def _plain(x):
    """Metadata with list and tuple containers alike (a restored quantized state is a tuple
    where a converted one was a list, on every backend: not a difference of bytes)."""
    if isinstance(x, dict):
        return {k: ("list" if v == "tuple" and k == "kind" else _plain(v)) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    return x


def assert_same(orig, restored) -> None:
    """Same class, scalar attributes, state layout and stored bits."""
    assert type(restored) is type(orig)
    for a, b in zip(getattr(orig, "caches", []), getattr(restored, "caches", []), strict=True):
        assert_same(a, b)
    assert scalar_attrs(restored) == scalar_attrs(orig)
    a, b = dump_prompt_cache(orig), dump_prompt_cache(restored)
    assert _plain(a.meta) == _plain(b.meta)
    assert record_bits(a) == record_bits(b)


def assert_same_window(orig, restored) -> None:
    """A window layer rebuilt from its blocks: the same class, offset and window, and the next
    updates (a chunk of 3 tokens, then one) return the same keys and values, bit for bit."""
    import copy

    assert type(restored) is type(orig) and restored.offset == orig.offset
    k = orig.keys
    outs = []
    for c in (copy.deepcopy(orig), restored):
        mx.random.seed(7)
        got = []
        for n in (3, 1):
            if hasattr(c, "maybe_trim_front"):
                c.maybe_trim_front()  # what the model calls before each chunk
            new = mx.random.normal((*k.shape[:-2], n, k.shape[-1])).astype(k.dtype)
            got += [bits(x) for x in c.update_and_fetch(new, new + 1)]
        outs.append(got)
    assert outs[0] == outs[1]


class Joins:
    """A DiskBackend wrapper that counts ``get_joined`` calls (to show the path was taken)."""

    def __init__(self, backend: DiskBackend) -> None:
        self.calls = 0
        inner = backend.get_joined

        def counted(keys, target, *more):
            self.calls += 1
            return inner(keys, target, *more)

        backend.get_joined = counted


def pair(root, hot_bytes=0, **kw):
    """A writer and a reader PrefixCache on one folder (two workers)."""
    uri = f"file://{root}/c"
    w = PrefixCache(uri, model="m", block_size=BS, hot_bytes=0, **kw)
    r = PrefixCache(uri, model="m", block_size=BS, hot_bytes=hot_bytes, **kw)
    return w, r


@pytest.mark.parametrize("case_id", ALL_CASES)
def test_restore_is_bit_exact_for_every_cache_class(tmp_path, case_id):
    cache = build_case(case_id)
    n = tokens_of(cache)
    toks = list(range(1, n + 1))
    w, r = pair(tmp_path)
    with w, r:
        joins = Joins(r.backend)
        w.store(toks, cache)
        hit = r.lookup(toks)
        assert hit is not None and hit.num_tokens == n
        for a, b in zip(cache, hit.prompt_cache, strict=True):
            if pr.layer_tag(a).startswith("w:") and not scalar_attrs(a) == scalar_attrs(b):
                assert_same_window(a, b)  # rebuilt from its blocks, not its stored state
            else:
                assert_same(a, b)
        assert joins.calls == 1  # the blocks came by get_joined


def kv_cache(n: int, seed: int = 0) -> list:
    from mlx_lm.models.cache import KVCache

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(3):
        c = KVCache()
        k, v = (
            mx.array(rng.integers(0, 2**16, (1, 2, n, 8), dtype=np.uint16)).view(mx.bfloat16)
            for _ in range(2)
        )
        c.update_and_fetch(k, v)
        out.append(c)
    mx.eval([c.state for c in out])
    return out


def block_files(backend: DiskBackend) -> dict[int, str]:
    """Block index -> file of every stored block record (by its ``start``)."""
    out = {}
    for key in backend.keys(""):
        path = backend._data / backend._lookup([key])[key]
        meta = reader.read_header(path).meta
        if meta.get("kind") == "block":
            out[meta["start"] // BS] = str(path)
    return out


def flip(path: str, where: str) -> None:
    """Flip one bit of a record file: in its tensor bytes, or in its header's metadata."""
    header = reader.read_header(path)
    with open(path, "r+b") as f:
        if where == "data":
            pos = header.data_offset + header.data_size // 2 + 3
        else:  # inside the base64 of the metadata
            pos = f.read(header.data_offset).index(b'"meta":"') + 12
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("where", ["data", "header"])
def test_a_flipped_byte_in_any_block_is_a_miss_from_there(tmp_path, monkeypatch, where, signed):
    if signed:
        monkeypatch.setenv("MLXCACHE_SECRET", "a-secret-of-at-least-16-chars")
    n = 5 * BS + 2  # five whole blocks and a partial one
    cache, toks = kv_cache(n), list(range(1, n + 1))
    for j in range(6):
        root = tmp_path / f"r{j}"
        w, r = pair(root)
        with w, r:
            w.store(toks, cache)
            flip(block_files(r.backend)[j], where)
            hit = r.lookup(toks)
            got = 0 if hit is None else hit.num_tokens
            assert got == j * BS, (j, got)  # the prefix ends before the bad block
            if got:
                for a, b in zip(cache, hit.prompt_cache, strict=True):
                    assert bytes(memoryview(b.keys[..., :got, :])) == bytes(
                        memoryview(mx.contiguous(a.keys[..., :got, :]))
                    )
            assert len(block_files(r.backend)) == 5  # the bad file is unindexed (quarantined)
            assert os.listdir(root / "c" / "quarantine")


def test_signed_reader_refuses_an_unsigned_block(tmp_path, monkeypatch):
    n = 3 * BS
    cache, toks = kv_cache(n), list(range(1, n + 1))
    w = PrefixCache(f"file://{tmp_path}/c", model="m", block_size=BS, hot_bytes=0)
    w.store(toks, cache)
    w.close()
    signer = Signer("a-secret-of-at-least-16-chars")
    with PrefixCache(
        DiskBackend(tmp_path / "c", signer=signer), model="m", block_size=BS, hot_bytes=0
    ) as r:
        assert r.lookup(toks) is None
        assert r.backend.stats()["rejected"] >= 1


def addresses(cache: list) -> list[tuple[int, int]]:
    """The memory ranges every key/value array of a restored cache uses."""
    out = []
    for c in cache:
        for a in (c.keys, c.values):
            view = np.frombuffer(memoryview(a).cast("B"), np.uint8)
            start = view.__array_interface__["data"][0]
            out.append((start, start + view.nbytes))
    return out


def overlaps(a: list, b: list) -> bool:
    return any(x0 < y1 and y0 < x1 for x0, x1 in a for y0, y1 in b)


def test_restores_never_share_memory_with_each_other(tmp_path):
    n = 4 * BS + 1
    cache, toks = kv_cache(n), list(range(1, n + 1))
    w, r = pair(tmp_path)
    with w, r:
        w.store(toks, cache)
        one, two = r.lookup(toks), r.lookup(toks)
        assert one.num_tokens == two.num_tokens == n
        assert not overlaps(addresses(one.prompt_cache), addresses(two.prompt_cache))
        assert not overlaps(addresses(one.prompt_cache), addresses(cache))


def test_a_changed_restore_never_reaches_another_one_or_the_hot_tier(tmp_path):
    n = 4 * BS
    cache, toks = kv_cache(n), list(range(1, n + 1))
    want = [bytes(memoryview(mx.contiguous(c.keys[..., :n, :]))) for c in cache]
    w, r = pair(tmp_path, hot_bytes=1 << 24)
    with w, r:
        w.store(toks, cache)
        first = r.lookup(toks)  # from file://, kept hot
        assert r.stats()["hot"]["entries"] == 1
        second = r.lookup(toks)  # from the hot tier
        for c in first.prompt_cache:  # a caller rewinds and writes over its last tokens
            c.trim(2)
            k = mx.full((1, 2, 2, 8), 7.0, dtype=mx.bfloat16)
            c.update_and_fetch(k, k)
        mx.eval([c.state for c in first.prompt_cache])
        third = r.lookup(toks)
        for hit in (second, third):
            got = [bytes(memoryview(mx.contiguous(c.keys[..., :n, :]))) for c in hit.prompt_cache]
            assert got == want


def test_a_block_of_another_layout_is_a_quiet_miss_and_stays(tmp_path):
    """A well-formed block that does not fit the join (here: other tensor shapes) ends the
    prefix there without being taken for corrupt (no quarantine)."""
    n = 3 * BS
    toks = list(range(1, n + 1))
    w, r = pair(tmp_path)
    with w, r:
        w.store(toks, kv_cache(n))
        files = block_files(r.backend)
        other = tmp_path / "other"
        with PrefixCache(f"file://{other}/c", model="m", block_size=BS, hot_bytes=0) as o:
            wide = kv_cache(n)
            for c in wide:  # head_dim 16 instead of 8
                c.keys = mx.concatenate([c.keys, c.keys], axis=-1)
                c.values = mx.concatenate([c.values, c.values], axis=-1)
            o.store(toks, wide)
            os.replace(block_files(o.backend)[1], files[1])  # same key, other layout
        hit = r.lookup(toks)
        assert hit is not None and hit.num_tokens == BS
        assert not os.listdir(tmp_path / "c" / "quarantine")
        assert len(block_files(r.backend)) == 3


def test_quantized_blocks_restore_as_the_concatenating_path_does(tmp_path):
    """kv_bits: quantized blocks joined in place, then dequantized, give the bits that the
    memory:// path (records concatenated) gives."""
    n = 3 * BS + 1
    cache, toks = kv_cache(n), list(range(1, n + 1))
    for c in cache:  # group size 64 needs a wider last axis
        c.keys = mx.concatenate([c.keys] * 8, axis=-1)
        c.values = mx.concatenate([c.values] * 8, axis=-1)
    got = []
    for uri in (f"file://{tmp_path}/c", "memory://"):
        with PrefixCache(uri, model="m", block_size=BS, hot_bytes=0, kv_bits=8) as w:
            w.store(toks, cache)
            hit = w.lookup(toks)
            assert hit.num_tokens == n
            got.append([bytes(memoryview(mx.contiguous(c.keys))) for c in hit.prompt_cache])
    assert got[0] == got[1]


def test_format_1_blocks_are_copied_in_and_still_checked(tmp_path):
    """Blocks written by mlxcache with format 1 (one sequential hash) are read whole and
    copied into their rows: the same restore; a flipped byte in one is still a miss there."""
    from test_format_pieces import as_version_1

    n = 3 * BS + 2
    cache, toks = kv_cache(n), list(range(1, n + 1))
    w, r = pair(tmp_path)
    with w, r:
        w.store(toks, cache)
        files = block_files(r.backend)
        for path in files.values():
            with open(path, "rb") as f:
                old = as_version_1(f.read())
            with open(path, "wb") as f:
                f.write(old)
        assert reader.read_header(files[1]).version == 1
        hit = r.lookup(toks)
        assert hit.num_tokens == n
        for a, b in zip(cache, hit.prompt_cache, strict=True):
            assert bytes(memoryview(b.keys)) == bytes(memoryview(mx.contiguous(a.keys[..., :n, :])))
        flip(files[2], "data")
        assert r.lookup(toks).num_tokens == 2 * BS


@pytest.mark.parametrize("change", [-2, 2])
def test_a_block_resized_after_its_table_was_parsed_is_still_a_miss(tmp_path, change):
    """Tensor tables are parsed once per process (``gather.Tables``, shared by every restore):
    a later restore still checks each file's size against the table, so a block cut short or
    grown after an earlier restore read it is a miss from there; the tables stay bounded."""
    from mlxcache.records import gather

    n = 3 * BS
    cache, toks = kv_cache(n), list(range(1, n + 1))
    w, r = pair(tmp_path)
    with w, r:
        w.store(toks, cache)
        assert r.lookup(toks).num_tokens == n  # the block table is parsed and kept here
        path = block_files(r.backend)[1]
        os.truncate(path, os.path.getsize(path) + change)
        assert r.lookup(toks).num_tokens == BS
        assert os.listdir(tmp_path / "c" / "quarantine")
    assert 0 < len(gather.Tables._seen) <= gather.Tables.KEEP
    assert gather.Tables._bytes == sum(len(t) for t in gather.Tables._seen)


def test_a_restore_asks_the_index_twice_and_touches_once(tmp_path, monkeypatch):
    """The probe, then one query for every file read (the blocks, the partial block and its
    tail: read whole in the same ``get_joined``), and one access-time update for all."""
    n = 3 * BS + 2  # three whole blocks, a partial one and its tail
    cache, toks = kv_cache(n), list(range(1, n + 1))
    w, r = pair(tmp_path)
    with w, r:
        w.store(toks, cache)
        asked, touched = [], []
        lookup, touch = r.backend._lookup, r.backend._touch
        monkeypatch.setattr(r.backend, "_lookup", lambda keys: asked.append(keys) or lookup(keys))
        monkeypatch.setattr(
            r.backend, "_touch", lambda pairs: touched.append(pairs) or touch(pairs)
        )
        hit = r.lookup(toks)
        assert hit.num_tokens == n
        assert len(asked) == 2 and len(asked[1]) == 5  # 3 blocks, the partial one, its tail
        assert len(touched) == 1 and len(touched[0]) == 5
        for a, b in zip(cache, hit.prompt_cache, strict=True):
            assert bytes(memoryview(b.keys)) == bytes(memoryview(mx.contiguous(a.keys[..., :n, :])))
