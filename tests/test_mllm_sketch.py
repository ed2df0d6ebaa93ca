"""The MLLM index's prefix sketches: compact lines, bounds that never undercount, old lines."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from test_mllm_cache import kv

from mlxcache.integrations.vllm_mlx import sketch
from mlxcache.mllm_cache import MLLMCacheManager
from mlxcache.records.record import Record


def common(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 400),
    st.integers(0, 400),
    st.integers(0, 400),
    st.integers(0, 3),
)
def test_bound_is_never_below_the_true_prefix_and_exact_in_the_head(shared, extra_a, extra_b, v):
    base = np.arange(shared, dtype=np.int64)
    a = np.concatenate([base, np.full(extra_a, 7 + v, dtype=np.int64)])
    b = np.concatenate([base, np.full(extra_b, 9, dtype=np.int64)])
    true = common(a, b)
    bound = sketch.match_bound(sketch.sketch(a), sketch.sketch(b))
    assert bound >= true
    assert bound <= min(len(a), len(b))
    if true < sketch.HEAD:
        assert bound == true  # short prefixes are measured exactly: no needless loads
    else:
        assert bound <= true + sketch.BLOCK  # off by at most one digest block


def test_a_long_line_is_over_50_times_smaller_than_the_token_ids():
    tokens = np.arange(32_768, dtype=np.int64)
    fields = sketch.sketch(tokens).as_fields()
    size = len(fields["head"]) + len(fields["blocks"])
    assert size * 50 < tokens.nbytes


def test_malformed_sketch_fields_are_refused():
    good = sketch.sketch(np.arange(300, dtype=np.int64)).as_fields()
    assert sketch.from_fields(good) is not None
    for bad in (
        {**good, "len": "300"},
        {**good, "len": 400},  # five digests due, four held
        {**good, "len": 10},  # ten head ids due, 64 held
        {**good, "head": good["head"][:-1]},
        {**good, "blocks": good["blocks"] + b"x" * 8},
        {"len": 3},
    ):
        assert sketch.from_fields(bad) is None


def test_long_prompts_rank_by_their_real_prefix(tmp_path):
    """Two entries that differ after the head: the fetch picks the longer real match."""
    m = MLLMCacheManager(backend=f"file://{tmp_path}/c")
    n = 200
    a = list(range(n))
    b = list(range(150)) + [9_999] * 50
    m.store(["img"], "a", None, kv(n, 1), a)
    m.store(["img"], "b", None, kv(n, 2), b)
    entry, got = m.fetch(["img"], "new", list(range(190)) + [5] * 20)
    assert got == 190 and entry.token_ids == a
    entry, got = m.fetch(["img"], "new2", list(range(150)) + [9_999] * 60)
    assert got == 200 and entry.token_ids == b


def test_index_lines_hold_no_token_ids(tmp_path):
    m = MLLMCacheManager(backend=f"file://{tmp_path}/c")
    m.store(["img"], "p", None, kv(4_000), list(range(4_000)))
    (ikey,) = list(m._backend.keys("mllm.i."))
    (line,) = m._backend.get(ikey).meta["entries"]
    assert "tokens" not in line and line["len"] == 4_000
    assert len(line["head"]) + len(line["blocks"]) < 4_000 * 8 // 25


def test_index_lines_written_before_sketches_still_find_their_entries(tmp_path):
    uri = f"file://{tmp_path}/c"
    m = MLLMCacheManager(backend=uri)
    tokens = list(range(300))
    m.store(["img"], "p", mx.ones((2, 2)), kv(300), tokens)
    (ikey,) = list(m._backend.keys("mllm.i."))
    rec = m._backend.get(ikey)
    (line,) = rec.meta["entries"]
    old = {k: v for k, v in line.items() if k not in ("len", "head", "blocks")}
    old["tokens"] = np.asarray(tokens, dtype=np.int64).tobytes()  # the earlier layout
    m._backend.put(ikey, Record(meta={**rec.meta, "entries": [old]}))
    fresh = MLLMCacheManager(backend=uri)
    assert len(fresh) == 1  # the warm start reads the old line
    entry, got = fresh.fetch(["img"], "other", tokens + [1, 2])
    assert got == 300 and entry.token_ids == tokens
