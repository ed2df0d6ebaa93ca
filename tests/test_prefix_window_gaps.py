"""A block written without a window layer's slice (its layer had dropped those tokens) is
completed by a later store that holds them: the first store marks it (``g/<h>``), a store whose
window layers hold the block rewrites it whole in the same store (no extra probe) and drops the
mark, and a prompt branching inside then hits at the block boundary it missed, bit for bit
like the engine. A store marked nothing before this change: its gapped blocks read as before (a
shorter hit or a miss, never a wrong state). A later stored length whose window needs a marked
block it holds only in part keeps that window whole in its tail (docs/prefix.md, "When a block
lacks its window slice")."""

from __future__ import annotations

import copy

import mlx.core as mx
import pytest
from helpers import bits
from test_integration_mlx_lm import build_folder, prompt_ids
from test_prefix_windows import _engine_at, _feed, _layers

from mlxcache import PrefixCache
from mlxcache.prefix import gaps

BS = 8


def _kinds(pc: PrefixCache) -> dict[str, int]:
    out: dict[str, int] = {}
    for k in pc.backend.keys(pc.key_prefix):
        kind = k[len(pc.key_prefix) :].split("/")[0]
        out[kind] = out.get(kind, 0) + 1
    return out


def _gapped_store(pc: PrefixCache, lib: str, kind: str) -> list:
    """40 tokens, the last 20 decoded one by one: the window layers dropped the first blocks
    before this store, so they are written without them (and marked)."""
    stored = _layers(lib, kind)
    _feed(stored, [20] + [1] * 20, seed=1)
    assert pc.store(list(range(40)), stored) == 40
    return stored


@pytest.mark.parametrize("lib", ["mlx_lm", "mlx_vlm"])
@pytest.mark.parametrize("kind", ["rotating", "chunked"])
def test_a_store_holding_the_window_completes_a_gapped_block(uri, lib, kind):
    pc = PrefixCache(uri, model="m", block_size=BS, hot_bytes=0)
    _gapped_store(pc, lib, kind)
    marks = _kinds(pc).get(gaps.KIND, 0)
    request = list(range(33)) + [99] * 6
    before = pc.lookup(request)
    assert before is None or before.num_tokens < 32  # the window at 32 lies in gapped blocks
    # a chunk store of a prefill that holds the first 32 tokens (one chunk: nothing dropped)
    holder = _layers(lib, kind)
    _feed(holder, [32], seed=1)
    assert pc.store(list(range(32)), holder, mid_prefill=True) == 0  # no new tokens
    hit = pc.lookup(request)
    assert hit is not None and hit.num_tokens == 32
    engine = _layers(lib, kind)
    _feed(engine, [32], seed=1)
    for chunks in ([6, 1], [1, 1, 1, 4]):
        a, b = copy.deepcopy(engine), copy.deepcopy(hit.prompt_cache)
        assert _feed(a, chunks, seed=2, start=32) == _feed(b, chunks, seed=2, start=32)
    # the blocks rewritten were marked, their marks are gone; done once: again writes nothing
    done = pc.stats()["blocks_completed"]
    assert marks >= done >= 2 and _kinds(pc).get(gaps.KIND, 0) == marks - done
    written = pc.stats()["records_written"]
    assert pc.store(list(range(32)), holder, mid_prefill=True) == 0
    assert pc.stats()["blocks_completed"] == done and pc.stats()["records_written"] == written


def test_a_store_from_before_the_marks_reads_as_before(monkeypatch):
    """Gapped blocks written without marks (before this change) stay as they were: a later
    store does not rewrite them (it cannot know), and a branch is a miss, never an error."""
    pc = PrefixCache("memory://", model="m", block_size=BS, hot_bytes=0)
    with monkeypatch.context() as m:
        m.setattr(gaps, "mark", lambda rec: None)
        _gapped_store(pc, "mlx_lm", "rotating")
    assert gaps.KIND not in _kinds(pc)
    holder = _layers("mlx_lm", "rotating")
    _feed(holder, [32], seed=1)
    assert pc.store(list(range(32)), holder, mid_prefill=True) == 0
    assert pc.stats()["blocks_completed"] == 0
    assert pc.lookup(list(range(33)) + [99]) is None
    assert pc.lookup(list(range(40)) + [7]).num_tokens == 40  # its stored length, from the tail
    assert pc.stats()["rejected"] == 0


def test_a_stored_length_whose_window_needs_a_marked_block_keeps_it_whole(uri):
    """A next turn (44 tokens, decoded on from the gapped store's cache) holds block 3 only in
    part: it cannot complete it, but its tail keeps the window layers whole, so its stored
    length hits; unmarked, the blocks it needs would make that a shorter hit."""
    pc = PrefixCache(uri, model="m", block_size=BS, hot_bytes=0)
    stored = _gapped_store(pc, "mlx_lm", "rotating")
    longer = copy.deepcopy(stored)
    _feed(longer, [1] * 4, seed=1, start=40)
    pc.store(list(range(44)), longer)
    hit = pc.lookup(list(range(44)) + [7])
    assert hit is not None and hit.num_tokens == 44
    engine = copy.deepcopy(longer)
    assert _feed(engine, [3, 1], 2, 44) == _feed(hit.prompt_cache, [3, 1], 2, 44)


def test_healing_a_gapped_block_marks_it_too(monkeypatch):
    """A hot prompt written back after its records were lost (prefix/heal.py) marks the blocks
    its window layers no longer hold, so a later store still completes them."""
    from mlxcache.backends.memory import MemoryBackend
    from mlxcache.prefix import hot as prefix_hot

    monkeypatch.setattr(prefix_hot, "TOUCH_EVERY", 0.0)  # every hot hit checks its records
    backend = MemoryBackend()
    a = PrefixCache(backend, model="m", block_size=BS)
    _gapped_store(a, "mlx_lm", "rotating")
    marks = _kinds(a)[gaps.KIND]
    backend.clear()  # lost
    assert a.lookup(list(range(40))).num_tokens == 40 and a.flush(10)  # hot: healed
    assert _kinds(a)[gaps.KIND] == marks
    b = PrefixCache(backend, model="m", block_size=BS, hot_bytes=0)
    holder = _layers("mlx_lm", "rotating")
    _feed(holder, [32], seed=1)
    b.store(list(range(32)), holder, mid_prefill=True)
    assert b.lookup(list(range(33)) + [99]).num_tokens == 32
    a.close(), b.close()


# ---------------------------------------------------------------- through mlx-lm's generation


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    import mlx_lm

    root = tmp_path_factory.mktemp("gap_models")
    return mlx_lm.load(str(build_folder("gemma3_text", root / "gemma3_text")))[0]


@pytest.mark.parametrize("where", ["memory", "file"])
def test_a_later_prefill_completes_a_prompt_stored_after_its_window_moved(gemma, tmp_path, where):
    """gemma3_text (RotatingKVCache(16) + KVCache), blocks of 32, chunks of 64. A prompt stored
    by hand at its end (the window layers hold its last tokens only): a branch at 140 misses.
    A second prompt sharing 150 tokens misses too, and its prefill's chunk stores rewrite the
    shared blocks whole; a third prompt branching at 140 then resumes at 128, answering as the
    engine resumed there and as the uncached engine."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcache.integrations.mlx_lm import generate_tokens

    uri = "memory://" if where == "memory" else f"file://{tmp_path}/c"
    cache = PrefixCache(uri, model="gemma3_text", block_size=32, hot_bytes=0)
    options = {"prefill_step_size": 64}
    ids = prompt_ids(200)
    engine = make_prompt_cache(gemma)
    for s in range(0, 199, 64):
        gemma(mx.array(ids[s : min(s + 64, 199)])[None], cache=engine)
        mx.eval([c.state for c in engine])
    assert cache.store(ids[:199], engine) == 199
    branched = ids[:140] + prompt_ids(60, seed=9)
    assert cache.longest(branched) == 128  # its blocks are there, gapped
    second = ids[:150] + prompt_ids(50, seed=5)
    r = generate_tokens(gemma, second, cache=cache, max_tokens=4, **options)
    assert r.cached_tokens == 0  # the window at 128 needs a gapped block
    r = generate_tokens(gemma, branched, cache=cache, max_tokens=4, **options)
    assert r.cached_tokens == 128
    assert cache.stats()["blocks_completed"] == 4  # blocks 0..3, shared with the first prompt
    got = (r.tokens, bits(r.first_logits - mx.logsumexp(r.first_logits, keepdims=True)))
    assert (
        got == _engine_at(gemma, branched, 128, options) == _engine_at(gemma, branched, 0, options)
    )
