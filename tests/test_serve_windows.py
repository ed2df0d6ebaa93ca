"""``mlxcache serve`` on sliding-window and hybrid models: a document shared inside the user turn
is reused by a second server (issue 26), and its answer is the stock ``mlx_lm.server``'s.

mlx-lm's server hands its prompt cache only segment ends; mlxcache also stores after each of its
prefill chunks, while a window layer still holds the chunk's blocks and where a state layer can
be checkpointed. Prefill steps of one block keep the stock server's splits on a hit.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_integration_mlx_lm import build_folder
from test_serve import Server

BLOCK = "32"
DOC = (
    "The cache keeps what the model has already computed, so a repeated prompt skips its "
    "prefill. A prompt is split into blocks of tokens; each block is named by a hash of every "
    "token before it. Two servers that share a store find each other's blocks, and a restarted "
    "server finds its own. Memory is fast and small, a disk is larger and survives a restart, "
    "and a network store is shared by many machines. When a store fails, the request runs "
    "without it and answers the same text. "
)
ASK = [
    [{"role": "user", "content": DOC + "Question: what does the cache keep?"}],
    [{"role": "user", "content": DOC + "Question: which store survives a restart?"}],
]
CONFIGS = json.loads((Path(__file__).parent / "families" / "mlx_lm_configs.json").read_text())
ARCH = {
    "gemma3_text": None,  # RotatingKVCache(16) and KVCache layers: the window is half a block
    "qwen3_5": {k: v for k, v in CONFIGS["qwen3_5"].items() if k != "model_type"},  # + ArraysCache
}


def _block_aligned_common(folder: str) -> int:
    """The block-aligned length of the two prompts' common start (chat template applied)."""
    from mlx_lm.tokenizer_utils import load

    tokenizer = load(Path(folder))
    a, b = (tokenizer.apply_chat_template(m, add_generation_prompt=True) for m in ASK)
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    return common // int(BLOCK) * int(BLOCK)


@pytest.mark.parametrize("family", sorted(ARCH))
def test_a_shared_document_hits_on_a_second_server(family, tmp_path):
    folder = str(build_folder(family, tmp_path / family, config=ARCH[family]))
    cache = f"file://{tmp_path}/cache"
    step = ("--prefill-step-size", BLOCK)
    with ThreadPoolExecutor(3) as pool:
        starting = [
            pool.submit(Server, folder, None, tmp_path / "stock.log", *step, plain=True),
            *(
                pool.submit(
                    Server,
                    folder,
                    cache,
                    tmp_path / f"ours{i}.log",
                    *step,
                    "--cache-block-size",
                    BLOCK,
                )  # fmt: skip
                for i in (1, 2)
            ),
        ]
    servers = [f.result() for f in starting if f.exception() is None]
    try:
        failed = [f.exception() for f in starting if f.exception() is not None]
        if failed:
            raise failed[0]
        stock, first, second = servers
        # batched (mlx-lm's BatchGenerator), and alone (a seed: mlx-lm's stream_generate) under
        # a salt of its own, so that only its own stores can serve its second request
        paths = ({}, {"seed": 7, "salt": "alone"})
        want = [[stock.chat(m, 6, seed=p.get("seed")) for m in ASK] for p in paths]
        cold = [first.chat(ASK[0], 6, **p) for p in paths]  # stored chunk by chunk
        warm = [second.chat(ASK[1], 6, **p) for p in paths]  # another process: the document
        log = second.log()
    finally:
        for server in servers:
            server.kill()
    shared = _block_aligned_common(folder)
    assert shared >= 3 * int(BLOCK)  # the document spans blocks past the window
    for w, c, h in zip(want, cold, warm, strict=True):
        assert c == (*w[0][:2], 0)
        assert h == (*w[1][:2], shared)
    assert f"a shared-tier hit ({shared} of {want[0][1][1]} tokens reused)" in log
