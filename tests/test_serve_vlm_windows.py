"""``mlxcache serve --engine mlx-vlm`` on sliding-window and hybrid models: an image and a
document shared inside the user turn are reused by a second server (issue 26), and the answer is
the stock ``mlx_vlm.server``'s.

mlx-vlm runs Gemma 3 (``RotatingKVCache`` layers, a 64-token window in the tiny folder) and
Qwen3.5 (a gated-delta ``ArraysCache`` layer) in checkpoint mode: as shipped it reuses a cache
only at exactly a stored length. mlxcache also stores after each prefill chunk (a window's whole
blocks while it holds them; a state at chunk ends on its stride) and answers mlx-vlm's checkpoint
lookup with the longest prefix the store rebuilds: Gemma 3's last shared block boundary, Qwen3.5's
last stride multiple. Prefill steps of one block keep the stock server's splits on such a hit,
where the answer must be its uncached one.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest
from helpers import started_together
from PIL import Image
from vlm_server import VlmServer, image, user_turn

from mlxcache.tiny_models import build_tiny_vlm

BLOCK = 16
TOKENS = 24
DOC = (
    "The cache keeps what the model has already computed, so a repeated prompt skips its "
    "prefill. Two servers that share a store find each other's blocks, and a restarted server "
    "finds its own. A disk is larger than memory and survives a restart. "
)
ASK = [
    [user_turn(["A"], DOC + "Question: what does the cache keep?")],
    [user_turn(["A"], DOC + "Question: which store survives a restart?")],
]


def _ids(folder: str, messages: list) -> list[int]:
    """A request's prompt token ids, formatted as mlx-vlm's server formats them."""
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import load_config, load_processor

    processor = load_processor(Path(folder))
    prompt = apply_chat_template(processor, load_config(Path(folder)), messages, num_images=1)
    pixels = Image.open(io.BytesIO(base64.b64decode(image("A").split(",", 1)[1])))
    return list(processor(text=[prompt], images=[pixels])["input_ids"][0])


def _stride(folder: str, step: int = BLOCK) -> int:
    """Where a state is checkpointed mid-prefill at BLOCK and a prefill step of ``step``."""
    import mlx.core as mx
    import mlx_vlm

    from mlxcache.prefix import checkpoints

    lm = mlx_vlm.load(folder)[0].language_model
    cache = lm.make_cache()
    lm(mx.array([[1] * 8]), cache=cache)
    every = checkpoints.stride(cache, BLOCK, checkpoints.DEFAULT_SHARE, step)
    assert every is not None and every % step == 0
    return every


@pytest.mark.parametrize("family", ["gemma3", "qwen3_5"])
def test_a_shared_document_hits_on_a_second_server(family, tmp_path):
    folder = str(build_tiny_vlm(tmp_path / family, family=family))
    cache = f"file://{tmp_path}/cache"
    step = ("--prefill-step-size", str(BLOCK))
    ours = (*step, "--cache-block-size", str(BLOCK))
    with started_together(  # the reference: mlx-vlm's own server, no APC, chunked as ours
        [
            lambda: VlmServer(folder, None, tmp_path / "stock.log", *step, plain=True),
            lambda: VlmServer(folder, cache, tmp_path / "ours1.log", *ours),
            lambda: VlmServer(folder, cache, tmp_path / "ours2.log", *ours),
        ]
    ) as (stock, first, second):
        # 24 tokens: the tiny Qwen3.5's first 8 are the same for both questions
        want = [stock.send(m, TOKENS) for m in ASK]
        cold = first.send(ASK[0], TOKENS)  # stored chunk by chunk
        warm = second.send(ASK[1], TOKENS)  # another process: the shared image and document
        repeat = second.send(ASK[1], TOKENS)  # its own checkpoint at the prompt's end
    ids = [_ids(folder, m) for m in ASK]
    assert [len(i) for i in ids] == [w[1] for w in want]
    common = next(i for i, (a, b) in enumerate(zip(*ids, strict=False)) if a != b)
    every = BLOCK if family == "gemma3" else _stride(folder)
    hit = common // every * every
    # Gemma 3: past the window (blocks the prompt's end no longer holds)
    assert hit >= 64 + 2 * BLOCK and every < BLOCK * 4
    assert all(w[2] == 0 for w in want) and want[0][0] != want[1][0]
    assert cold == want[0]
    assert warm == (want[1][0], want[1][1], hit)  # on the stock server's splits: its answer
    assert repeat[:2] == want[1][:2] and repeat[2] == want[1][1] - 1
