"""Checkpoints of state layers (ArraysCache) at a stride and at branch points (docs/prefix.md).

A prompt of a hybrid model leaves its state at every stride multiple (the smallest multiple of
``lcm(block, prefill step)`` whose state stays within ``checkpoint_share`` of its KV bytes); a
request that branches off a stored prompt resumes at the nearest checkpoint at or before the
branch and leaves one at the last block boundary before it, which the next request branching
there resumes fully. A cold prefill splits exactly where the engine's does, so its answer is the
engine's uncached one even where any split changes the numerics (mlx-vlm's qwen3_5); with a
prefill step of one block every checkpoint is on the engine's own chunks, and every answer is
the uncached engine's at that step (tokens and every step's log-probabilities), mlx-lm's
(qwen3_5) and mlx-vlm's (qwen3_5, gated-delta; lfm2_vl, short-conv); off that grid (a step of
24), the engine resumed at the same splits. A corrupt checkpoint is a miss.
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
    """qwen3_5 (tiny, mlx-lm): 58,368 state bytes, 2,048 KV bytes per token; the stride is a
    multiple of lcm(block, prefill step)."""
    from mlx_lm.models.cache import make_prompt_cache

    model = lm.build("qwen3_5")
    fresh = make_prompt_cache(model)
    assert checkpoints.stride(fresh, BS, 1.0, BS) is None  # no state yet: not known
    model(mx.array(lm.text("qwen3_5", 40, 1))[None], cache=fresh)
    assert checkpoints.state_bytes(fresh) == 58368
    assert checkpoints.kv_bytes_per_token(fresh) == 2048
    # lcm * ceil(58368 / (share * 2048 * lcm))
    assert checkpoints.stride(fresh, BS, 1.0, BS) == 32
    assert checkpoints.stride(fresh, BS, 0.25, BS) == 128
    assert checkpoints.stride(fresh, BS, 1.0, 24) == 48  # lcm(16, 24)
    assert checkpoints.stride(fresh, BS, 0.25, 2048) == 2048  # the default step
    assert checkpoints.stride(fresh, 256, 0.25, 2048) == 2048
    assert checkpoints.stride(fresh, BS, 0.001, 2048) == 2048 * 14  # ceil(58368 / 4194.304)
    mamba = lm.build("mamba2")  # no KV layers: the lcm
    state = make_prompt_cache(mamba)
    mamba(mx.array(lm.text("mamba2", 8, 1))[None], cache=state)
    assert checkpoints.stride(state, BS, 0.25, 2048) == 2048
    assert checkpoints.stride(state, BS, 0.25, 40) == 80
    with pytest.raises(ValueError, match="checkpoint_share"):
        PrefixCache("memory://", model="m", checkpoint_share=0)


def _ends(marks: checkpoints.Checkpoints, s: int, end: int, learnt: int) -> list[int]:
    """The chunk ends of a prefill from ``s``, the stride learnt after the first chunk."""
    ends = []
    while s < end:
        s = marks.next_end(s, end)
        ends.append(s)
        marks.stride = marks.stride or learnt
    return ends


def test_a_cold_prefill_ends_its_chunks_where_the_engine_does():
    """Nothing restored, no branch point: every ``step`` tokens and the end, as mlx-lm's and
    mlx-vlm's own chunked prefill (no split to measure the state, none between steps)."""
    marks = checkpoints.Checkpoints(BS, 1.0, step=24)
    assert _ends(marks, 0, 150, learnt=48) == [24, 48, 72, 96, 120, 144, 150]
    assert [e for e in [24, 48, 72, 96, 120, 144, 150] if marks.keeps(e)] == [48, 96, 144]
    marks = checkpoints.Checkpoints(BS, 1.0, step=2048)
    assert _ends(marks, 0, 95, learnt=2048) == [95]


def test_chunks_also_end_on_the_branch_and_on_the_stride_when_resumed_off_it():
    marks = checkpoints.Checkpoints(BS, 1.0, step=40, branch=48)
    ends = _ends(marks, 0, 95, learnt=80)
    assert ends == [40, 48, 80, 95]  # the engine's first chunk, the branch, the stride
    assert [e for e in ends if marks.keeps(e)] == [48, 80]
    marks = checkpoints.Checkpoints(BS, 1.0, step=24, stride=48)  # resumed at 40 (a length)
    assert _ends(marks, 40, 150, learnt=48) == [48, 72, 96, 120, 144, 150]


# ---------------------------------------------------------------- mlx-lm


def _lm_run(model, ids, cache, step=BS, splits=()):
    """mlxcache's answer, which must be mlx-lm's uncached ``generate_step`` at ``step`` (every
    split mlxcache makes is one of the engine's own chunk ends), or resumed at ``splits``."""
    from mlxcache.integrations.mlx_lm import stream_generate_tokens

    steps = list(
        stream_generate_tokens(
            model, ids, cache=cache, max_tokens=harness.MAX_TOKENS, prefill_step_size=step
        )
    )
    result = steps[-1].result
    got = (result.tokens, harness.digest([s.logprobs for s in steps]))
    assert got == lm.reference(model, ids, splits, step=step)
    return result.cached_tokens


def _vlm_run(spec, model, ids, cache, step=BS, splits=()):
    """As ``_lm_run``, against mlx-vlm's ``generate_step`` at ``step``."""
    _, pixels, kwargs = harness.prompt(spec)
    kwargs = {**kwargs, "prefill_step_size": step}
    got, digest, result = harness.ours(model, ids, pixels, kwargs, cache)
    want = harness.reference(model, ids, pixels, kwargs, splits)
    assert (got, digest) == want
    return result.cached_tokens, want


SPECS = {s.name: s for s in specs_qwen.SPECS + specs_guards.SPECS}


@pytest.mark.parametrize("step", [BS, 2048])
def test_a_cold_prefill_through_the_cache_answers_like_the_uncached_engine(tmp_path, step):
    """qwen3_5, mlx-lm and mlx-vlm, at a step of one block and at the default 2,048: a prompt
    run cold through mlxcache (which stores its checkpoints) is the engine's own uncached
    answer, bit for bit; mlx-vlm's qwen3_5 answers differently at the two steps (any split
    changes it), so an extra split would show."""
    model = lm.build("qwen3_5")
    cache = _cache(tmp_path, "lm", share=1.0)  # stride 32 at a step of 16, else 2048
    assert _lm_run(model, lm.text("qwen3_5", N, 1), cache, step) == 0
    assert sorted(_tails(cache)) == ([32, 64, 95] if step == BS else [95])

    spec = SPECS["qwen3_5"]
    model = harness.build(spec)
    cache = _cache(tmp_path, "vlm", share=0.25)  # stride 32 at a step of 16, else 2048
    ids, pixels, kwargs = harness.prompt(spec)
    cached, want = _vlm_run(spec, model, ids, cache, step)
    assert cached == 0
    assert sorted(_tails(cache)) == ([32, 64, 95] if step == BS else [95])
    other = {**kwargs, "prefill_step_size": 2048 if step == BS else BS}
    assert want != harness.reference(model, ids, pixels, other)
    assert _vlm_run(spec, model, ids, cache, step)[0] == N - 1  # a repeat: the same answer


@pytest.mark.parametrize("engine", ["mlx_lm", "mlx_vlm"])
def test_a_branch_off_the_steps_grid_is_the_engine_resumed_at_the_same_splits(tmp_path, engine):
    """qwen3_5 at a step of 24 on blocks of 16, 120 tokens: a stride of 48 (the lcm); a cold
    prompt splits as the engine (24, 48, 72, 96); a branch at 70 resumes at 48, adds its branch
    point (64) and then splits at the stride (96) too: the engine resumed at 64 and 96
    (mlx-vlm's changes at any split)."""
    n = 120
    if engine == "mlx_lm":
        model, share, ids = lm.build("qwen3_5"), 1.0, lm.text("qwen3_5", n, 1)

        def run(tokens, splits=()):
            return _lm_run(model, tokens, cache, 24, splits)

        def text(k, seed):
            return lm.text("qwen3_5", k, seed)

    else:
        spec, share = SPECS["qwen3_5"], 0.25
        model, ids = harness.build(spec), harness.prompt(spec, n=n)[0]

        def run(tokens, splits=()):
            return _vlm_run(spec, model, tokens, cache, 24, splits)[0]

        def text(k, seed):
            return harness.text(spec, k, seed)

    cache = _cache(tmp_path, engine, share)
    assert run(ids) == 0
    assert sorted(_tails(cache)) == [48, 96, 119]
    assert run(ids[:70] + text(n - 70, 7), [64, 96]) == 48
    assert 64 in _tails(cache)
    assert run(ids[:70] + text(n - 70, 8), [64, 96]) == 64  # resumes at the branch point


def test_mlx_lm_branches_resume_at_checkpoints_like_the_engine(tmp_path):
    model = lm.build("qwen3_5")
    cache = _cache(tmp_path, "qwen3_5", share=1.0)  # stride 32 (two blocks) at a step of 16
    ids = lm.text("qwen3_5", N, 1)
    assert _lm_run(model, ids, cache) == 0  # cold: the engine's chunks, stored at the stride
    assert sorted(_tails(cache)) == [32, 64, 95]
    # branched at 50: resumes at the stride checkpoint 32, leaves one at 48 (3 whole blocks)
    branched = ids[:50] + lm.text("qwen3_5", N - 50, 7)
    assert _lm_run(model, branched, cache) == 32
    assert 48 in _tails(cache)
    # a third request branching there (at 55) resumes at 48, all of the shared blocks
    third = ids[:55] + lm.text("qwen3_5", N - 55, 8)
    assert _lm_run(model, third, cache) == 48
    # the checkpoint at 48 corrupted on disk: a miss (never its bytes), the prompt recomputed
    (name,) = _tails(cache)[48]
    flip(str(cache.backend._data / name), "data")
    fourth = ids[:60] + lm.text("qwen3_5", N - 60, 9)
    assert _lm_run(model, fourth, cache) == 0


def test_a_store_without_checkpoints_still_hits_at_its_length_and_learns_the_branch(tmp_path):
    """A prompt stored as before (only its length, computed in one call: mlx-lm's chunk at its
    default step): a repeat hits, a branch misses cleanly and leaves its branch point, which
    the next branch there resumes."""
    from mlx_lm.models.cache import make_prompt_cache

    model = lm.build("qwen3_5")
    cache = _cache(tmp_path, "old", share=1.0)
    ids = lm.text("qwen3_5", N, 1)
    old = make_prompt_cache(model)
    model(mx.array(ids[:95])[None], cache=old)
    cache.store(ids[:95], old)  # no stride tails
    assert _lm_run(model, ids, cache, step=2048) == 95
    assert sorted(_tails(cache)) == [95]
    assert _lm_run(model, ids[:50] + lm.text("qwen3_5", N - 50, 7), cache) == 0
    assert _lm_run(model, ids[:50] + lm.text("qwen3_5", N - 50, 8), cache) == 48


# ---------------------------------------------------------------- mlx-vlm


@pytest.mark.parametrize("name, share", [("qwen3_5", 0.25), ("lfm2_vl", 0.0625)])
def test_mlx_vlm_branches_resume_at_checkpoints_like_the_engine(tmp_path, name, share):
    """qwen3_5: 2,816 state bytes, 512 KV bytes per token; lfm2_vl: 512 and 256: both a stride
    of 32 (two blocks) at these shares and a step of 16. qwen3_5's numerics change at every
    split: each answer is the uncached engine's at that step."""
    spec = SPECS[name]
    model = harness.build(spec)
    cache = _cache(tmp_path, name, share)
    ids = harness.prompt(spec)[0]

    def run(tokens):
        return _vlm_run(spec, model, tokens, cache)[0]

    assert run(ids) == 0
    assert sorted(_tails(cache)) == [32, 64, 95]
    assert run(ids[:50] + harness.text(spec, N - 50, 7)) == 32
    assert 48 in _tails(cache)
    assert run(ids[:55] + harness.text(spec, N - 55, 8)) == 48
    (name_48,) = _tails(cache)[48]
    flip(str(cache.backend._data / name_48), "data")
    assert run(ids[:60] + harness.text(spec, N - 60, 9)) == 0


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe", "lfm2_vl"])
def test_the_matrix_hybrids_have_no_stride_checkpoint_in_its_prompts(name):
    """tests/families/harness.py resumes the engine at the hit and the branch point only: at
    the matrix's block and the default share and step, the stride of these is 2,048 tokens."""
    import importlib

    prefill = importlib.import_module("mlxcache.integrations.mlx_vlm.prefill").prefill
    spec = SPECS[name]
    model = harness.build(spec)
    ids, pixels, kwargs = harness.prompt(spec)
    cache = PrefixCache("memory://", model=name, block_size=harness.BLOCK, hot_bytes=0)
    done = prefill(model, mx.array([ids]), pixels, cache=cache, **kwargs)
    got = checkpoints.stride(done.prompt_cache, harness.BLOCK, checkpoints.DEFAULT_SHARE, 2048)
    assert got == 2048 > harness.PROMPT


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
    assert _lm_run(model, ids, first) == 0
    assert _lm_run(model, ids[:50] + lm.text("qwen3_5", N - 50, 7), first) == 32
    other = worker()
    assert _lm_run(model, ids[:55] + lm.text("qwen3_5", N - 55, 8), other) == 48
    assert _lm_run(model, ids, other) == 95
