"""Checkpoints of state layers (ArraysCache) at a stride and at branch points (docs/prefix.md).

A prompt of a hybrid model leaves its state at every stride multiple (the smallest multiple of the
block whose state stays within ``checkpoint_share`` of its KV bytes); a request that branches off
a stored prompt resumes at the nearest checkpoint at or before the branch and leaves one at the
last block boundary before it, which the next request branching there resumes fully. Every answer
is the engine's resumed at the same splits (tokens and every step's log-probabilities), mlx-lm's
(qwen3_5) and mlx-vlm's (qwen3_5, gated-delta; lfm2_vl, short-conv); a corrupt checkpoint is a miss.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from test_prefix_restore import flip

from mlxcache import PrefixCache
from mlxcache.prefix import checkpoints
from mlxcache.records import reader

pytest.importorskip("mlx_lm")
pytest.importorskip("mlx_vlm")

from families import harness, lm, specs_guards, specs_qwen  # noqa: E402

BS = 16
N = 96


def _cache(tmp_path, name: str, share: float) -> PrefixCache:
    uri = f"file://{tmp_path / name}"
    return PrefixCache(uri, model=name, block_size=BS, hot_bytes=0, checkpoint_share=share)


def _tails(cache: PrefixCache) -> dict[int, list[str]]:
    """Stored tail records (file://): length -> their file names (one per stored prompt)."""
    b = cache.backend
    out = {}
    for key in b.keys(cache.key_prefix):
        name = b._lookup([key])[key]
        meta = reader.read_header(b._data / name).meta
        if meta.get("kind") == "tail":
            out.setdefault(meta["length"], []).append(name)
    return out


def test_the_stride_bounds_state_bytes_by_a_share_of_the_kv_bytes():
    """qwen3_5 (tiny, mlx-lm): 58,368 state bytes, 2,048 KV bytes per token."""
    from mlx_lm.models.cache import make_prompt_cache

    model = lm.build("qwen3_5")
    fresh = make_prompt_cache(model)
    assert checkpoints.stride(fresh, BS, 1.0, 2048) is None  # no state yet: not known
    model(mx.array(lm.text("qwen3_5", 40, 1))[None], cache=fresh)
    assert checkpoints.state_bytes(fresh) == 58368
    assert checkpoints.kv_bytes_per_token(fresh) == 2048
    # ceil(58368 / (share * 2048 * block)) blocks
    assert checkpoints.stride(fresh, BS, 1.0, 2048) == 32
    assert checkpoints.stride(fresh, BS, 0.25, 2048) == 128
    assert checkpoints.stride(fresh, 256, 0.25, 2048) == 256
    mamba = lm.build("mamba2")  # no KV layers: the prefill step, in whole blocks
    state = make_prompt_cache(mamba)
    mamba(mx.array(lm.text("mamba2", 8, 1))[None], cache=state)
    assert checkpoints.stride(state, BS, 0.25, 2048) == 2048
    assert checkpoints.stride(state, BS, 0.25, 40) == 32
    with pytest.raises(ValueError, match="checkpoint_share"):
        PrefixCache("memory://", model="m", checkpoint_share=0)


def test_chunks_end_on_the_first_block_the_stride_and_the_branch():
    marks = checkpoints.Checkpoints(BS, 1.0, step=40, branch=48)
    ends, s = [], 0
    while s < 95:
        e = marks.next_end(s, 95)
        ends.append(e)
        marks.stride = marks.stride or 32  # learnt after the first chunk
        s = e
    assert ends == [16, 32, 48, 64, 95]
    assert [e for e in ends if marks.keeps(e)] == [32, 48, 64]
    marks = checkpoints.Checkpoints(BS, 1.0, step=24, stride=64)
    ends, s = [], 0
    while s < 150:
        s = marks.next_end(s, 150)
        ends.append(s)
    assert ends == [24, 48, 64, 88, 112, 128, 150]  # never longer than the prefill step


# ---------------------------------------------------------------- mlx-lm


def _lm_run(model, ids, cache, splits):
    from mlxcache.integrations.mlx_lm import stream_generate_tokens

    steps = list(stream_generate_tokens(model, ids, cache=cache, max_tokens=harness.MAX_TOKENS))
    result = steps[-1].result
    got = (result.tokens, harness.digest([s.logprobs for s in steps]))
    assert got == lm.reference(model, ids, splits)  # the engine resumed at the same splits
    return result.cached_tokens


def test_mlx_lm_branches_resume_at_checkpoints_like_the_engine(tmp_path):
    model = lm.build("qwen3_5")
    cache = _cache(tmp_path, "qwen3_5", share=1.0)  # stride 32 (two blocks)
    ids = lm.text("qwen3_5", N, 1)
    # cold: the first block (the state's size is not known before), then the stride
    assert _lm_run(model, ids, cache, [16, 32, 64]) == 0
    assert sorted(_tails(cache)) == [32, 64, 95]
    # branched at 50: resumes at the stride checkpoint 32, leaves one at 48 (3 whole blocks)
    branched = ids[:50] + lm.text("qwen3_5", N - 50, 7)
    assert _lm_run(model, branched, cache, [16, 32, 48, 64]) == 32
    assert 48 in _tails(cache)
    # a third request branching there (at 55) resumes at 48, all of the shared blocks
    third = ids[:55] + lm.text("qwen3_5", N - 55, 8)
    assert _lm_run(model, third, cache, [16, 32, 48, 64]) == 48
    # the checkpoint at 48 corrupted on disk: a miss (never its bytes), the prompt recomputed
    (name,) = _tails(cache)[48]
    flip(str(cache.backend._data / name), "data")
    fourth = ids[:60] + lm.text("qwen3_5", N - 60, 9)
    assert _lm_run(model, fourth, cache, [16, 32, 48, 64]) == 0


def test_a_store_without_checkpoints_still_hits_at_its_length_and_learns_the_branch(tmp_path):
    """A prompt stored as before (only its length): a repeat hits, a branch misses cleanly and
    leaves its branch point, which the next branch there resumes."""
    from mlx_lm.models.cache import make_prompt_cache

    model = lm.build("qwen3_5")
    cache = _cache(tmp_path, "old", share=1.0)
    ids = lm.text("qwen3_5", N, 1)
    old = make_prompt_cache(model)
    model(mx.array(ids[:95])[None], cache=old)
    cache.store(ids[:95], old)  # no stride tails
    assert _lm_run(model, ids, cache, [95]) == 95
    branched = ids[:50] + lm.text("qwen3_5", N - 50, 7)
    assert _lm_run(model, branched, cache, [16, 32, 48, 64]) == 0
    assert _lm_run(model, ids[:50] + lm.text("qwen3_5", N - 50, 8), cache, [16, 32, 48, 64]) == 48


# ---------------------------------------------------------------- mlx-vlm

SPECS = {s.name: s for s in specs_qwen.SPECS + specs_guards.SPECS}


@pytest.mark.parametrize("name, share", [("qwen3_5", 0.25), ("lfm2_vl", 0.0625)])
def test_mlx_vlm_branches_resume_at_checkpoints_like_the_engine(tmp_path, name, share):
    """qwen3_5: 2,816 state bytes, 512 KV bytes per token; lfm2_vl: 512 and 256: both a stride
    of 32 (two blocks) at these shares. qwen3_5's numerics change at every split."""
    spec = SPECS[name]
    model = harness.build(spec)
    cache = _cache(tmp_path, name, share)
    ids, pixels, kwargs = harness.prompt(spec)

    def run(tokens, splits):
        got, digest, result = harness.ours(model, tokens, pixels, kwargs, cache)
        assert (got, digest) == harness.reference(model, tokens, pixels, kwargs, splits)
        return result.cached_tokens

    assert run(ids, [16, 32, 64]) == 0
    assert sorted(_tails(cache)) == [32, 64, 95]
    assert run(ids[:50] + harness.text(spec, N - 50, 7), [16, 32, 48, 64]) == 32
    assert 48 in _tails(cache)
    assert run(ids[:55] + harness.text(spec, N - 55, 8), [16, 32, 48, 64]) == 48
    (name_48,) = _tails(cache)[48]
    flip(str(cache.backend._data / name_48), "data")
    assert run(ids[:60] + harness.text(spec, N - 60, 9), [16, 32, 48, 64]) == 0


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe", "lfm2_vl"])
def test_the_matrix_hybrids_have_a_stride_of_one_block(name):
    """tests/families/harness.py resumes the engine at every block boundary for these: their
    stride at the matrix's block and the default share is one block."""
    import importlib

    prefill = importlib.import_module("mlxcache.integrations.mlx_vlm.prefill").prefill
    spec = SPECS[name]
    model = harness.build(spec)
    ids, pixels, kwargs = harness.prompt(spec)
    cache = PrefixCache("memory://", model=name, block_size=harness.BLOCK, hot_bytes=0)
    done = prefill(model, mx.array([ids]), pixels, cache=cache, **kwargs)
    got = checkpoints.stride(done.prompt_cache, harness.BLOCK, checkpoints.DEFAULT_SHARE, 2048)
    assert got == harness.BLOCK


def test_checkpoints_are_shared_through_redis(redis_url):
    """On a real redis-server (the one-trip chain walk): a second PrefixCache, as another
    worker, resumes at the branch point the first one's request left, like the engine."""
    model = lm.build("qwen3_5")
    ids = lm.text("qwen3_5", N, 1)

    def worker() -> PrefixCache:
        return PrefixCache(
            redis_url, model="qwen3_5", block_size=BS, hot_bytes=0, checkpoint_share=1.0
        )

    first = worker()
    assert _lm_run(model, ids, first, [16, 32, 64]) == 0
    assert _lm_run(model, ids[:50] + lm.text("qwen3_5", N - 50, 7), first, [16, 32, 48, 64]) == 32
    other = worker()
    assert _lm_run(model, ids[:55] + lm.text("qwen3_5", N - 55, 8), other, [16, 32, 48, 64]) == 48
    assert _lm_run(model, ids, other, [16, 32, 64, 95]) == 95
