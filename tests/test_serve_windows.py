"""``mlxcache serve`` on sliding-window and hybrid models: a document shared inside the user turn
is reused by a second server (issue 26), and its answer is the stock ``mlx_lm.server``'s.

mlx-lm's server hands its prompt cache only segment ends; mlxcache also stores after each of its
prefill chunks, while a window layer still holds the chunk's blocks and where a state layer can
be checkpointed. Prefill steps of one block keep the stock server's splits on a hit that lies on
them, where the answer must be the stock server's (uncached) text.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_integration_mlx_lm import build_folder
from test_serve import Server

BLOCK = 32
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
SYSTEM = {
    "role": "system",
    "content": "You answer in short words. Memory is fast and small, a disk is larger.",
}
# (request options, the two requests): batched (mlx-lm's BatchGenerator); alone (a seed: its
# stream_generate) under a salt of its own, so that only its own stores serve it; batched after
# a system message, whose segment ends off a block boundary, and so do the chunks after it
CASES = (
    ({}, ASK),
    ({"seed": 7, "salt": "alone"}, ASK),
    ({"salt": "system"}, [[SYSTEM, *m] for m in ASK]),
)
CONFIGS = json.loads((Path(__file__).parent / "families" / "mlx_lm_configs.json").read_text())
ARCH = {
    "gemma3_text": None,  # RotatingKVCache(16) and KVCache layers: the window is half a block
    "qwen3_5": {k: v for k, v in CONFIGS["qwen3_5"].items() if k != "model_type"},  # + ArraysCache
}


def _prompts(folder: str, *requests) -> list[list[int]]:
    """The token ids of requests (chat template applied, as mlx-lm's server does)."""
    from mlx_lm.tokenizer_utils import load

    tokenizer = load(Path(folder))
    return [tokenizer.apply_chat_template(m, add_generation_prompt=True) for m in requests]


def _stride(folder: str, step: int = BLOCK) -> int:
    """The state checkpoint stride of a model at BLOCK and a prefill step (BLOCK)."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcache.prefix import checkpoints

    model, _ = load(folder)
    cache = make_prompt_cache(model)
    model(mx.array([[1] * 8]), cache=cache)
    every = checkpoints.stride(cache, BLOCK, checkpoints.DEFAULT_SHARE, step)
    assert every is not None and every % BLOCK == 0
    return every


def _common(a: list[int], b: list[int]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)


@pytest.mark.parametrize("family", sorted(ARCH))
def test_a_shared_document_hits_on_a_second_server(family, tmp_path):
    folder = str(build_folder(family, tmp_path / family, config=ARCH[family]))
    cache = f"file://{tmp_path}/cache"
    step = ("--prefill-step-size", str(BLOCK))
    ours = (*step, "--cache-block-size", str(BLOCK))
    with ThreadPoolExecutor(3) as pool:
        starting = [
            # the reference: uncached (an LRU of no entries), chunked as ours
            pool.submit(Server, folder, None, tmp_path / "stock.log", *step,
                        "--prompt-cache-size", "0", plain=True),
            *(pool.submit(Server, folder, cache, tmp_path / f"ours{i}.log", *ours)
              for i in (1, 2)),
        ]  # fmt: skip
    servers = [f.result() for f in starting if f.exception() is None]
    try:
        failed = [f.exception() for f in starting if f.exception() is not None]
        if failed:
            raise failed[0]
        stock, first, second = servers
        want = [[stock.chat(m, 6, seed=o.get("seed")) for m in asks] for o, asks in CASES]
        cold = [first.chat(asks[0], 6, **o) for o, asks in CASES]  # stored chunk by chunk
        warm = [second.chat(asks[1], 6, **o) for o, asks in CASES]  # another process
        log = second.log()
    finally:
        for server in servers:
            server.kill()
    assert all(w[2] == 0 for pair in want for w in pair)  # the engine's own, uncached
    system, *ids = _prompts(folder, [SYSTEM, {"role": "user", "content": ""}],
                            *(m for _, asks in CASES for m in asks))  # fmt: skip
    prompts = [ids[i : i + 2] for i in range(0, len(ids), 2)]
    system_end = _common(system, prompts[2][1])  # where mlx-lm ends the system segment
    assert system_end % BLOCK  # the chunks after it start off the blocks
    shared = [_common(*p) // BLOCK * BLOCK for p in prompts]
    assert min(shared) >= 3 * BLOCK  # the document spans blocks past the window
    if family == "qwen3_5":  # state checkpoints: at chunk ends on the stride only
        every = _stride(folder)
        shared = [n // every * every for n in shared[:2]] + [system_end // every * every]
    compared = 0
    for w, c, h, hit, start in zip(want, cold, warm, shared, (0, 0, system_end), strict=True):
        assert c == (*w[0][:2], 0)
        assert h[1:] == (w[1][1], hit)
        # the answer where the hit is on the stock server's splits (its segment's chunks)
        if hit <= start or (hit - start) % BLOCK == 0:
            assert h[0] == w[1][0]
            compared += 1
    assert compared == (3 if family == "qwen3_5" else 2)
    assert f"a shared-tier hit ({shared[0]} of {want[0][1][1]} tokens reused)" in log
