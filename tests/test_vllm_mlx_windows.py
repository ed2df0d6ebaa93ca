"""``mlxcache serve --engine vllm-mlx --continuous-batching`` on sliding-window and hybrid
models: a document shared inside the user turn is reused by a second server (issue 26).

vllm-mlx stores a request's cache when it finishes, after its window layers dropped the
document's blocks and with its state layers at that one length; mlxcache also stores after each
of the scheduler's prefill chunks (``chunk_stores.py``). Prefill steps of one block keep vllm-mlx's
own splits on every hit, so each answer must be vllm-mlx's own server's, caches off.
"""

from __future__ import annotations

from functools import partial

import pytest
from helpers import started_together
from test_integration_mlx_lm import build_folder
from test_serve_windows import ARCH, ASK, BLOCK, _common, _prompts, _stride
from vllm_servers import Server, require_vllm_python, server_args

OPTIONS = ("--continuous-batching", "--prefill-step-size", str(BLOCK))


def _start(python: str, folder: str, cache: str | None, log, home) -> Server:
    args = server_args(python, folder, cache, cache is None)
    if cache is not None:  # our blocks: BLOCK tokens, the prefill step
        i = args.index("--cache-block-size")
        args[i + 1] = str(BLOCK)
    return Server([*args, *OPTIONS], log, home)


@pytest.mark.parametrize("family", sorted(ARCH))
def test_a_shared_document_hits_on_a_second_server(family, tmp_path):
    python = require_vllm_python()
    folder = str(build_folder(family, tmp_path / family, config=ARCH[family]))
    cache = f"file://{tmp_path}/cache"
    make = [
        partial(_start, python, folder, c, tmp_path / f"{name}.log", tmp_path / name)
        for name, c in (("stock", None), ("first", cache), ("second", cache))
    ]
    with started_together(make) as (stock, first, second):
        want = [stock.chat(m, 6) for m in ASK]
        cold = [first.chat(ASK[0], 6), first.chat(ASK[0], 6, salt="alice")]
        warm = second.chat(ASK[1], 6)  # another process: the first one's chunks
        again = second.chat(ASK[0], 6)  # the first prompt again: all but its last token
        salted = [second.chat(ASK[1], 6, salt=s) for s in ("alice", "bob")]
        stats = second.get("/v1/cache/stats")["engine_cache"]["mlxcache"]
    assert all(w[2] is None for w in want)  # vllm-mlx as shipped, caches off
    ids = _prompts(folder, *ASK)
    assert [w[1] for w in want] == [len(p) for p in ids]  # the same chat template
    hit = _common(*ids) // BLOCK * BLOCK
    assert hit >= 3 * BLOCK  # the document spans blocks past the window
    if family == "qwen3_5":  # state checkpoints: at chunk ends on the stride only
        every = _stride(folder)
        hit = hit // every * every
        assert hit >= every
    assert cold == [(*want[0][:2], 0)] * 2
    assert warm == (*want[1][:2], hit)  # vllm-mlx's own answer, resumed on its own splits
    assert again == (*want[0][:2], want[0][1] - 1)
    assert salted == [(*want[1][:2], hit), (*want[1][:2], 0)]  # each salt's own chunks
    assert stats["lookup_errors"] == stats["store_errors"] == 0
