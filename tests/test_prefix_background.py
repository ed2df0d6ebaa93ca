"""PrefixCache.store(..., background=True): puts off the caller's thread, flush(), no aliasing,
dropped stores counted, a crash with writes queued leaves a readable store."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm.models.cache import make_prompt_cache

from mlxcache import PrefixCache, open_backend
from mlxcache.backends.memory import MemoryBackend
from mlxcache.backends.writer import BackgroundWriter
from mlxcache.tiny_models import build_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BS = 16


@pytest.fixture(scope="module")
def qwen():
    return build_model("qwen2_vl")[0]


def prefill(model, ids, cache=None):
    lm = model.language_model
    lm._rope_deltas, lm._position_ids = None, None
    cache = make_prompt_cache(lm) if cache is None else cache
    logits = lm(mx.array([list(ids)]), cache=cache).logits[0, -1]
    mx.eval(logits)
    return logits, cache


def prompt(n, seed=0):
    return np.random.default_rng(seed).integers(1, 900, n).tolist()


def state_bits(cache) -> list[bytes]:
    return [bytes(memoryview(mx.contiguous(a))) for c in cache for a in c.state]


class GatedBackend(MemoryBackend):
    """A memory backend whose puts wait for ``gate`` and record the thread they ran on."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.put_threads: set[str] = set()

    def put(self, key, record):
        self.gate.wait(30)
        self.put_threads.add(threading.current_thread().name)
        super().put(key, record)


def test_background_store_then_flush_hits_like_a_sync_store(uri, qwen):
    ids = prompt(40)
    _, cache = prefill(qwen, ids)
    with PrefixCache(uri, model="qwen", block_size=BS) as pc:
        assert pc.store(ids, cache, background=True) == 40  # queued
        assert pc.flush(60)
        hit = pc.lookup(ids)
        assert hit is not None and hit.num_tokens == 40
        assert state_bits(hit.prompt_cache) == state_bits(cache)
        s = pc.stats()
        assert s["tokens_written"] == 40 and s["writer"]["written"] == 1
        assert s["writer"]["dropped"] == 0


def test_puts_run_on_the_writer_thread_and_the_caller_does_not_wait(qwen):
    backend = GatedBackend()
    ids = prompt(40, seed=1)
    _, cache = prefill(qwen, ids)
    pc = PrefixCache(backend, model="qwen", block_size=BS)
    # the puts cannot finish until the gate opens: store returning proves the caller did not wait
    assert pc.store(ids, cache, background=True) == 40
    assert len(backend) == 0 and pc.writer.pending == 1
    backend.gate.set()
    assert pc.flush(60)
    assert backend.put_threads == {"mlxcache-prefix-writer"}
    assert pc.lookup(ids).num_tokens == 40
    pc.close()


def test_the_caller_may_change_its_cache_at_once(qwen):
    """The queued records are snapshots: decoding into (or trimming) the live cache right after
    store() returns does not change what is written."""
    backend = GatedBackend()
    ids = prompt(40, seed=2)
    _, cache = prefill(qwen, ids)
    before = state_bits(cache)
    pc = PrefixCache(backend, model="qwen", block_size=BS)
    pc.store(ids, cache, background=True)
    for c in cache:
        c.trim(8)  # rewind 8 tokens and write other ones over them
    prefill(qwen, prompt(20, seed=9), cache)
    backend.gate.set()
    assert pc.flush(60)
    hit = pc.lookup(ids)
    assert hit.num_tokens == 40 and state_bits(hit.prompt_cache) == before
    pc.close()


def test_a_full_queue_drops_the_store_and_counts_it(qwen):
    backend = GatedBackend()
    pc = PrefixCache(
        backend, model="qwen", block_size=BS, hot_bytes=0
    )  # the writer, not the hot tier
    pc.writer = BackgroundWriter(queue=1, full="drop")
    a, b = prompt(40, seed=3), prompt(40, seed=4)
    _, ca = prefill(qwen, a)
    _, cb = prefill(qwen, b)
    assert pc.store(a, ca, background=True) == 40
    assert pc.store(b, cb, background=True) == 0  # dropped: nothing queued
    backend.gate.set()
    assert pc.flush(60)
    assert pc.lookup(a).num_tokens == 40
    assert pc.lookup(b) is None
    assert pc.stats()["writer"]["dropped"] == 1
    pc.close()


def test_close_writes_what_was_queued(tmp_path, qwen):
    uri = f"file://{tmp_path}/c"
    ids = prompt(40, seed=5)
    _, cache = prefill(qwen, ids)
    pc = PrefixCache(uri, model="qwen", block_size=BS)
    pc.store(ids, cache, background=True)
    pc.close()
    with PrefixCache(uri, model="qwen", block_size=BS) as again:
        assert again.lookup(ids).num_tokens == 40


def test_a_crash_with_writes_queued_leaves_a_readable_store(tmp_path):
    """A process killed (os._exit) while its writer runs: what was written is whole and
    verifies, the rest is missing; the store opens and serves without errors."""
    uri = f"file://{tmp_path}/c"
    code = textwrap.dedent(
        f"""
        import os, threading
        import mlx.core as mx
        import numpy as np
        from mlx_vlm.models.cache import make_prompt_cache
        from mlxcache import PrefixCache
        from mlxcache.tiny_models import build_model
        model = build_model("qwen2_vl")[0]
        lm = model.language_model
        pc = PrefixCache({uri!r}, model="qwen", block_size={BS})
        for seed in range(6):
            ids = np.random.default_rng(100 + seed).integers(1, 900, 64).tolist()
            lm._rope_deltas, lm._position_ids = None, None
            cache = make_prompt_cache(lm)
            mx.eval(lm(mx.array([ids]), cache=cache).logits)
            pc.store(ids, cache, background=True)
        os._exit(0)  # no flush, no atexit: queued writes are lost
        """
    )
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    backend = open_backend(uri)
    keys = list(backend.keys())
    records = backend.get_many(keys)
    assert all(r is not None for r in records)  # everything indexed is whole
    assert backend.stats()["errors"] == 0
    with PrefixCache(backend, model="qwen", block_size=BS) as pc:
        for seed in range(6):
            ids = np.random.default_rng(100 + seed).integers(1, 900, 64).tolist()
            hit = pc.lookup(ids)
            assert hit is None or hit.num_tokens % BS == 0 or hit.num_tokens == 64
    assert pc.stats()["rejected"] == 0
