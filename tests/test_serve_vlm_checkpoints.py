"""``mlxcache serve --engine mlx-vlm`` shares mlx-vlm's checkpoint-mode APC (issue 26).

A tiny Gemma 3 (sliding-window layers) and a tiny Qwen3.5 (a gated-delta recurrent layer): on
both mlx-vlm's APC runs in checkpoint mode. An image prompt (longer than Gemma 3's 64-token
window) is answered on one server; a second live server on the same ``file://`` cache, then a
restarted one (SIGKILL), hit where the stock ``mlx_vlm.server`` with its own APC on hits in its
process, with the same text and the same ``cached_tokens``; another question on the same image
hits Gemma 3's shared blocks (``chunk_stores.py``). Subprocesses and real HTTP.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from vlm_server import VlmServer, user_turn

from mlxcache.tiny_models import build_tiny_vlm

LONG = (
    "Describe this image in detail: the colours, the shapes, where each one is and its size. " * 3
)
NEXT = {"role": "user", "content": "And what colour is the background?"}
BLOCK = ("--cache-block-size", "16")


def _start_both(folder: str, cache: str, tmp_path) -> tuple[VlmServer, VlmServer]:
    """The stock server with its APC on, and ours, started together."""
    with ThreadPoolExecutor(2) as pool:
        starting = [
            pool.submit(VlmServer, folder, None, tmp_path / "stock.log", plain=True, apc=True),
            pool.submit(VlmServer, folder, cache, tmp_path / "first.log", *BLOCK),
        ]
    failed = [f.exception() for f in starting if f.exception() is not None]
    if failed:
        for f in starting:
            if f.exception() is None:
                f.result().kill()
        raise failed[0]
    stock, ours = (f.result() for f in starting)
    return stock, ours


@pytest.mark.parametrize("family", ["gemma3", "qwen3_5"])
def test_checkpoints_are_shared_with_a_second_server_and_a_restart(family, tmp_path):
    folder = str(build_tiny_vlm(tmp_path / family, family=family))
    cache = f"file://{tmp_path}/cache"
    stock, first = _start_both(folder, cache, tmp_path)
    servers = [stock, first]
    try:
        turn1 = [user_turn(["A"], LONG)]
        # the stock server: cold, then its in-process checkpoint serves the repeat
        cold = stock.send(turn1)
        repeat = stock.send(turn1)
        turn2 = [*turn1, {"role": "assistant", "content": cold[0]}, NEXT]
        follow = stock.send(turn2)
        again = stock.send(turn2)
        n1, n2 = cold[1], follow[1]
        assert n1 > 64 and cold[2] == 0 and cold[0].strip()  # past the sliding window
        assert repeat[:2] == cold[:2] and 0 < repeat[2] < n1
        assert 0 < follow[2] < n2 and again[:2] == follow[:2] and follow[2] < again[2] < n2
        # ours: the first server answers cold, as the stock one
        assert first.send(turn1) == cold
        # a second live server on the same cache: the first's checkpoint, mlx-vlm's answer
        second = VlmServer(folder, cache, tmp_path / "second.log", *BLOCK)
        servers.append(second)
        assert second.send(turn1) == repeat
        assert second.send(turn2) == follow
        stats = json.loads(second.get("/v1/cache/stats"))
        assert stats["mlxcache"]["hits"] >= 1 and stats["exact_hits"] == 2
        # another question on the same image: the stock server's checkpoint serves only its
        # own length; ours rebuilds Gemma 3's window layers at a block boundary of the shared
        # part (stored after each prefill chunk: test_serve_vlm_windows.py checks its answer
        # where it lies on the stock server's splits), and Qwen3.5's state only where stored
        # (nothing before this branch: a miss, which ends a chunk at its branch point, 128, and
        # leaves a checkpoint there, test_serve_vlm_branches.py; the split leaves these tokens
        # the stock server's); another tenant's salt finds nothing either
        branch = [user_turn(["A"], LONG + " Is there a circle?")]
        stock_branch = stock.send(branch)
        got = second.send(branch)
        assert stock_branch[2] == 0 and got[1] == stock_branch[1]
        if family == "gemma3":
            assert got[2] % 16 == 0 and 64 < got[2] < n1
        else:
            assert got == stock_branch
        assert second.send(turn2, salt="alice") == (follow[0], n2, 0)
        # SIGKILL both, start again: the next turn's checkpoint (stored by the second) hits
        first.kill()
        second.kill()
        restarted = VlmServer(folder, cache, tmp_path / "restart.log", *BLOCK)
        servers.append(restarted)
        assert restarted.send(turn2) == again
        assert restarted.send(turn1) == repeat
    finally:
        for server in servers:
            server.kill()
