"""``SharedAPCManager`` in mlx-vlm's checkpoint mode (issue 26): the state mlx-vlm stores with
``store_exact_cache`` is found by another manager on the same ``file://`` store at exactly
that length, and resumes as mlx-vlm's own in-process checkpoint does; a corrupt record is a
miss and a log line. Real tiny language models of both checkpoint-mode kinds: Gemma 3
(sliding-window layers) and Qwen3.5 (gated-delta recurrent layers); real arrays.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import pytest
from families import harness, specs_qwen
from redis_server import RedisServer
from test_checkpoints import _tails
from test_prefix_restore import flip

from mlxcache import PrefixCache
from mlxcache.integrations.mlx_vlm.apc import ImageDigests, SharedAPCManager
from mlxcache.tiny_models import build_model
from mlxcache.uri import open_backend

N = 100  # past Gemma 3's 64-token window: the rotating layers have dropped their first tokens


@pytest.fixture(scope="module", params=["gemma3", "qwen3_5"])
def lm(request):
    if request.param == "gemma3":
        return build_model("gemma3", 0)[0].language_model
    spec = next(s for s in specs_qwen.SPECS if s.name == "qwen3_5")
    return harness.build(spec).language_model


def _manager(where) -> SharedAPCManager:
    """A manager on its own backend object and prefix cache (another server's, or a restart):
    a ``file://`` folder, or a URI."""
    uri = where if isinstance(where, str) else f"file://{where}"
    prefix = PrefixCache(open_backend(uri), model="gemma3-test", block_size=16)
    return SharedAPCManager(prefix, ImageDigests())


def _prefill(lm, ids: list[int], step: int = 48) -> list:
    """mlx-vlm's language model over ``ids`` in chunks of ``step``, as its prefill runs."""
    cache = lm.make_cache()
    for i in range(0, len(ids), step):
        lm(mx.array([ids[i : i + step]]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def _logits(lm, cache: list, suffix: list[int]) -> bytes:
    out = lm(mx.array([suffix]), cache=cache).logits
    return bytes(memoryview(out.astype(mx.float32)))


def test_another_manager_resumes_the_checkpoint_as_mlx_vlm_in_process(lm, tmp_path, caplog):
    ids = [int(t) for t in mx.random.randint(1, 900, (N + 8,), key=mx.random.key(3)).tolist()]
    first = _manager(tmp_path / "cache")
    assert first.store_exact_cache(ids[:N], _prefill(lm, ids[:N]))
    for suffix in ([ids[N]], ids[N : N + 6]):  # one token (the guard), and a next turn
        own, n_own = first.lookup_exact_cache(ids[:N] + suffix)  # mlx-vlm's in-process entry
        other = _manager(tmp_path / "cache")
        shared, n_shared = other.lookup_exact_cache(ids[:N] + suffix)
        assert n_own == n_shared == N
        assert other.prefix.stats()["hits"] == 1 and other.stats.exact_hits == 1
        assert _logits(lm, shared, suffix) == _logits(lm, own, suffix)
    # a branch inside a stored prompt (one of 60 tokens: its blocks hold every window
    # position): mlx-vlm's checkpoint serves only its length; the shared store rebuilds
    # window layers at the block boundary 48 (the engine resumed there: same logits), a
    # state layer only where stored
    short = [t % 899 + 1 for t in ids[:60]]
    assert first.store_exact_cache(short, _prefill(lm, short))
    branch = short[:50] + [7, 8, 9]
    if lm.model_type == "gemma3_text":
        other = _manager(tmp_path / "cache")
        cache, n = other.lookup_exact_cache(branch)
        assert n == 48 and other.stats.exact_hits == 1
        engine = _prefill(lm, branch[:48])
        assert _logits(lm, cache, branch[48:]) == _logits(lm, engine, branch[48:])
    else:
        assert first.lookup_exact_cache(branch) == (None, 0)
        assert _manager(tmp_path / "cache").lookup_exact_cache(branch) == (None, 0)
    # the stored checkpoint corrupted on disk: a miss and a log line, never its bytes
    reader = _manager(tmp_path / "cache")
    for name in _tails(reader.prefix)[N]:
        flip(str(reader.prefix.backend._data / name), "data")
    with caplog.at_level(logging.WARNING, logger="mlxcache"):
        assert reader.lookup_exact_cache(ids[: N + 1]) == (None, 0)
    assert "the record is corrupt" in caplog.text  # the file backend's line (quarantined)
    assert reader.prefix.stats()["misses"] == 1


def test_a_dead_redis_is_a_miss_and_a_log_line_and_the_in_process_checkpoint_stays(
    lm, tmp_path, caplog
):
    ids = [int(t) for t in mx.random.randint(1, 900, (N + 1,), key=mx.random.key(5)).tolist()]
    redis = RedisServer()
    try:
        first = _manager(redis.url)
        assert first.store_exact_cache(ids[:N], _prefill(lm, ids[:N]))
        assert _manager(redis.url).lookup_exact_cache(ids)[1] == N  # shared while it lives
        redis.stop()
        other = _manager(redis.url)
        with caplog.at_level(logging.WARNING, logger="mlxcache"):
            assert other.lookup_exact_cache(ids) == (None, 0)
            assert first.lookup_exact_cache(ids)[1] == N  # mlx-vlm's own entry answers
            assert other.store_exact_cache(ids[:N], _prefill(lm, ids[:N]))  # kept in process
        assert "redis" in caplog.text.lower()
    finally:
        redis.close()


def test_stores_after_each_chunk_serve_a_branch_past_the_window(lm, tmp_path):
    """``store_prefill`` after each chunk (as ``chunk_stores.py`` calls it): a prompt that
    shares 100 tokens resumes at 96 from another manager, with the logits of the engine
    resumed there. Gemma 3's window has dropped those blocks by the prompt's end; Qwen3.5's
    state is checkpointed at its stride (32 at block and step 16), so an off-stride chunk end
    stores nothing for it."""
    ids = [int(t) for t in mx.random.randint(1, 900, (N + 28,), key=mx.random.key(7)).tolist()]
    first = _manager(tmp_path / "cache")
    cache = lm.make_cache()
    kept = {}
    for e in range(16, len(ids), 16):
        lm(mx.array([ids[e - 16 : e]]), cache=cache)
        kept[e] = first.store_prefill(ids[:e], cache, step=16)
    assert kept[32] and all(kept.values()) == (lm.model_type == "gemma3_text")
    branch = ids[:N] + [7, 8, 9]
    other = _manager(tmp_path / "cache")
    restored, n = other.lookup_exact_cache(branch)
    assert n == 96 and other.stats.exact_hits == 1
    engine = _prefill(lm, branch[:96], step=16)
    assert _logits(lm, restored, branch[96:]) == _logits(lm, engine, branch[96:])
