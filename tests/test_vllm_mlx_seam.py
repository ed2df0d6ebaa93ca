"""The parts of the vllm-mlx seam that need no vllm-mlx: the prompt count that carries cached
tokens, the version range, salt sentinels, salted system-prompt snapshots and the
default-mode chunk stores' lookups."""

from __future__ import annotations

import os
import subprocess
import sys

from mlxcache.integrations.vllm_mlx import salts
from mlxcache.integrations.vllm_mlx.engine_salts import SaltedSnapshots
from mlxcache.integrations.vllm_mlx.usage import PromptCount


def test_prompt_count_is_its_number_and_carries_cached_tokens():
    n = PromptCount(300, 299)
    assert n == 300 and n + 1 == 301 and isinstance(n, int)
    assert n.cached_tokens == 299
    assert PromptCount(5, 9).cached_tokens == 5  # never more than the prompt
    assert PromptCount(5, -1).cached_tokens == 0


def test_a_sum_of_counts_sums_their_cached_tokens():
    total = 0
    for n in (PromptCount(10, 4), PromptCount(20, 19), 7):
        total += n
    assert total == 37 and total.cached_tokens == 23


def test_a_version_outside_the_tested_range_is_one_line_before_any_model(tmp_path):
    """An installed vllm-mlx 0.7.1 (its distribution metadata first on the path): one line."""
    info = tmp_path / "vllm_mlx-0.7.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-mlx\nVersion: 0.7.1\n")
    run = subprocess.run(
        [sys.executable, "-m", "mlxcache", "serve", "--engine", "vllm-mlx", "--model", "m"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.getcwd()])),
    )
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "vllm-mlx 0.7.1 is outside the tested range" in lines[0], run.stderr


def test_a_forgotten_salt_sentinel_still_marks_a_salted_key():
    """A key whose salt fell out of the sentinels remembered is still salted (``keyed``): the
    shared tier then keeps it in memory only, never under the plain tokens."""
    key = salts.salted([5, 6, 7], "alice")
    assert salts.keyed(key) and salts.key_salt(key) == "alice" and salts.unsalted(key) == [5, 6, 7]
    assert not salts.keyed([5, 6, 7]) and salts.salted(key, "bob") == key
    for i in range(4100):  # more salts than are remembered
        salts.sentinel(f"user {i}")
    assert salts.keyed(key) and salts.key_salt(key) == ""
    assert salts.sentinel("alice") == tuple(key[: salts.SENTINEL])  # the same words again


def test_system_prompt_snapshots_are_each_salts_own():
    """vllm-mlx's system-prompt KV LRU under ``engine_salts``: a key is found only under the
    salt (or no salt) it was stored with."""
    snapshots = SaltedSnapshots()
    snapshots["h"] = "plain"
    with salts.serving("alice"):
        assert "h" not in snapshots and snapshots.get("h") is None
        snapshots["h"] = "alice's"
        snapshots.move_to_end("h")
        assert snapshots["h"] == "alice's"
    with salts.serving("bob"):
        assert "h" not in snapshots and snapshots.pop("h", None) is None
    assert snapshots["h"] == "plain" and len(snapshots) == 2


def test_prefill_chunks_store_window_layers_always_and_state_layers_on_the_stride():
    """``resume.chunk_store_due`` (vllm-mlx's chunk stores): a window layer's blocks after every
    chunk, a state layer's checkpoint only at chunk ends on the stride (a multiple of block and
    step), plain KV never (vllm-mlx's own store at the request's end covers it)."""
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

    from mlxcache.integrations.resume import chunk_store_due as store_due
    from mlxcache.prefix import checkpoints

    kv, window, state = KVCache(), RotatingKVCache(max_size=4), ArraysCache(2)
    for c in (kv, window):
        c.update_and_fetch(mx.ones((1, 2, 8, 16)), mx.ones((1, 2, 8, 16)))
    state[0], state[1] = mx.ones((1, 3, 64)), mx.ones((1, 4, 32, 32))
    assert all(store_due([kv, window], n, 16, 16) for n in (16, 20, 33))
    assert not any(store_due([kv], n, 16, 16) for n in (16, 32, 48))
    for step in (16, 24):
        every = checkpoints.stride([kv, state], 16, checkpoints.DEFAULT_SHARE, step)
        assert every is not None and every % 16 == 0 and every % step == 0
        due = [n for n in range(1, 3 * every + 1) if store_due([kv, state], n, 16, step)]
        assert due == [every, 2 * every, 3 * every]


def test_default_mode_chunks_store_under_their_own_lookup_only(tmp_path):
    """``trie_chunks``: the patched ``stream_generate`` stores a hybrid's checkpoint at its
    2,048-token chunk end under the lookup noted for it, takes that lookup once, and stores
    nothing under a lookup that is not the prompt's (a stale one) or without one (real tiny
    qwen3_5, mlx-lm's own ``stream_generate``)."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache
    from test_integration_mlx_lm import build_folder
    from test_serve_windows import ARCH

    from mlxcache.integrations.mlx_lm.chunk_stores import stream_generate_with_stores
    from mlxcache.integrations.mlx_lm.prompt_cache import SharedPromptCache
    from mlxcache.integrations.vllm_mlx import trie_chunks

    model, tokenizer = mlx_lm.load(str(build_folder("qwen3_5", tmp_path, ARCH["qwen3_5"])))
    lookup = trie_chunks._Lookup()
    generate = stream_generate_with_stores(mlx_lm.stream_generate, lookup, lookup.key)
    store = SharedPromptCache(backend="memory://", identity=str, block_size=32, background=False)
    one, two, three = ([7 + i % 50 + k for i in range(2100)] for k in (0, 100, 200))

    def run(prompt: list[int]) -> None:
        cache = make_prompt_cache(model)
        for _ in generate(model, tokenizer, prompt=mx.array(prompt), max_tokens=1,
                          prompt_cache=cache):  # fmt: skip
            pass

    def reused(tokens: list[int], n: int = 2048) -> int:
        cache, rest = store.fetch_nearest_cache("m", tokens[:n] + [1, 2])
        return 0 if cache is None else n + 2 - len(rest)

    trie_chunks.looked_up(store, "m", one)
    run(one)
    stale = two[:2048] + one  # ends in ``one``: its chunk would end on the stride (4096)
    trie_chunks.looked_up(store, "m", stale)
    run(three)  # not the prompt being prefilled: nothing
    run(one)  # the stale lookup was taken: none for this call
    assert [reused(one), reused(two), reused(three), reused(stale, 4096)] == [2048, 0, 0, 0]
