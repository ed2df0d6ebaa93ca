"""``mlxcache serve --engine mlx-vlm`` on tiny Gemma 3 and Qwen3-VL folders (issue 25): a
repeated image request is cached and answers what the stock ``mlx_vlm.server`` (its cache off)
answers, greedy, from the same folder.

One stock and one mlxcache server per family, started together (subprocesses, real HTTP).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from vlm_server import VlmServer

from mlxcache.tiny_models import build_tiny_vlm

# what serves the repeat: Qwen3-VL's dense KV goes through mlxcache's prefix cache on the
# store; Gemma 3's sliding-window layers put mlx-vlm's APC in checkpoint mode: its in-process
# checkpoint serves the repeat, and the same checkpoint is written to the store for other
# servers and restarts (tests/test_serve_vlm_checkpoints.py)
SERVED_BY = {"qwen3_vl": "mlxcache", "gemma3": "mlx-vlm checkpoint"}


@pytest.mark.parametrize("family", sorted(SERVED_BY))
def test_repeat_is_cached_and_answers_the_stock_server_text(family, tmp_path):
    folder = str(build_tiny_vlm(tmp_path / family, family=family))
    cache = f"file://{tmp_path}/cache"
    with ThreadPoolExecutor(2) as pool:
        starting = [
            pool.submit(VlmServer, folder, None, tmp_path / "stock.log", plain=True),
            pool.submit(
                VlmServer, folder, cache, tmp_path / "ours.log", "--cache-block-size", "16"
            ),
        ]
    servers = [f.result() for f in starting if f.exception() is None]
    try:
        failed = [f.exception() for f in starting if f.exception() is not None]
        if failed:
            raise failed[0]
        stock, ours = servers
        want, n, stock_cached = stock.chat(["A"])
        cold = ours.chat(["A"])
        warm = ours.chat(["A"])
        stats = json.loads(ours.get("/v1/cache/stats"))
    finally:
        for server in servers:
            server.kill()
    assert want.strip() and stock_cached == 0
    assert cold == (want, n, 0)
    text, n_warm, cached = warm
    assert (text, n_warm) == (want, n) and 0 < cached < n
    if SERVED_BY[family] == "mlxcache":
        assert stats["mlxcache"]["hits"] == 1 and stats["mlxcache"]["tokens_reused"] == cached
        # block mode: one lookup per request, its own (the checkpoint path stays mlx-vlm's)
        assert stats["mlxcache"]["lookups"] == 2 and stats["exact_hits"] == 0
    else:
        # the cold request asked the store (a miss), the repeat found its checkpoint in process
        assert stats["exact_hits"] == 1 and stats["mlxcache"]["hits"] == 0
        assert stats["mlxcache"]["lookups"] == 1 and stats["mlxcache"]["stores"] >= 1
