"""``mlxcache serve --engine mlx-vlm`` on a hybrid model leaves a checkpoint at a branch point
(issue 26).

The tiny Qwen3.5 VLM (gated-delta and attention layers): mlx-vlm runs its APC in checkpoint
mode. An image and a document are stored by one request; a second one branches inside the
document off the stride: it resumes at the stride checkpoint before the branch, and mlx-vlm's
prefill ends one more chunk at the last block boundary before the branch (one more of the row's
checkpoint lengths), where its state is stored; a third request on another server that branches
at the same place resumes there. Every answer (token and log-probability of each step, as the
server returns them) is mlx-vlm's engine at the same splits: the stock ``mlx_vlm.server``
uncached for the first, and for the other two the stock server with its own APC checkpointing
at the branch point (``APC_CHECKPOINT_INTERVAL_TOKENS``: the one stride below the prompt's end),
which resumes them there in its process. A model without state layers (the tiny Gemma 3:
sliding-window layers, resumed at any block boundary) looks for no branch point and adds no
split. Subprocesses and real HTTP.
"""

from __future__ import annotations

import json

import pytest
from helpers import started_together
from test_serve_vlm_windows import BLOCK, DOC, _ids, _stride
from vlm_server import VlmServer, user_turn

from mlxcache.tiny_models import build_tiny_vlm

STEP, MAX = 2 * BLOCK, 12  # a step of two blocks: a branch point at an odd block is new
WORDS = (DOC + DOC).split(" ")
AT = 74  # the word the documents differ at
QUESTION = "Question: what does the cache keep?"


def _ask(word: str) -> list[dict]:
    return [user_turn(["A"], " ".join([*WORDS[:AT], word, *WORDS[AT + 1 :]]) + QUESTION)]


ASKS = [_ask(w) for w in (WORDS[AT], "beside", "under")]


def _chat(server: VlmServer, messages: list) -> tuple[list[tuple[str, float]], int]:
    """The answer's (token, log-probability) pairs and the cached tokens of one greedy request."""
    body = {
        "model": server.model,
        "messages": messages,
        "max_tokens": MAX,
        "temperature": 0.0,
        "logprobs": True,
    }
    out = server.post("/v1/chat/completions", body)
    steps = [(s["token"], s["logprob"]) for s in out["choices"][0]["logprobs"]["content"]]
    details = out["usage"].get("prompt_tokens_details") or {}
    return steps, details.get("cached_tokens", 0)


def _common(a: list[int], b: list[int]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3"])
def test_a_branch_inside_a_document_is_checkpointed_for_the_next_server(family, tmp_path):
    folder = str(build_tiny_vlm(tmp_path / family, family=family))
    prompts = [_ids(folder, m) for m in ASKS]
    branch = _common(prompts[0], prompts[1])
    assert branch == _common(prompts[0], prompts[2]) == _common(prompts[1], prompts[2])
    b = branch // BLOCK * BLOCK  # the branch point (Gemma 3: past its 64-token window)
    if family == "qwen3_5":
        every = _stride(folder, STEP)
        hit = branch // every * every  # the stride checkpoint before it
        assert 0 < hit < b and (b - hit) % STEP  # not one of the first request's chunk ends
    else:
        hit = b  # its window layers' blocks: the branch point itself
        assert b % STEP and b > 64 + BLOCK
    # the stock server's interval checkpoints: only b below each prompt's last token
    assert all(b < len(p) - 1 < 2 * b for p in prompts)
    cache = f"file://{tmp_path}/cache"
    step = ("--prefill-step-size", str(STEP))
    ours = (*step, "--cache-block-size", str(BLOCK))
    at_b = {"APC_CHECKPOINT_INTERVAL_TOKENS": str(b)}
    with started_together(
        [
            lambda: VlmServer(folder, None, tmp_path / "plain.log", *step, plain=True),
            lambda: VlmServer(
                folder, None, tmp_path / "stock.log", *step, plain=True, apc=True, env=at_b
            ),
            lambda: VlmServer(folder, cache, tmp_path / "ours1.log", *ours),
            lambda: VlmServer(folder, cache, tmp_path / "ours2.log", *ours),
        ]
    ) as (plain, stock, first, second):
        got = [
            _chat(first, ASKS[0]),  # stored
            _chat(first, ASKS[1]),  # branches inside the document
            _chat(second, ASKS[2]),  # branches there too, on another server
        ]
        uncached = [_chat(plain, m) for m in ASKS]  # mlx-vlm with no splits but its step's
        split = [_chat(stock, m) for m in ASKS]  # mlx-vlm checkpointing (and resuming) at b
        stats = [json.loads(s.get("/v1/cache/stats")) for s in (first, second)]
    answers, cached = zip(*got, strict=True)
    assert cached == (0, hit, b)  # Qwen3.5 without branch points, the third one: ``hit``
    assert [c for _, c in uncached] == [0, 0, 0] and [c for _, c in split] == [0, b, b]
    assert all(len(a) == MAX for a in answers)
    assert answers[0] == uncached[0][0]  # no branch point: the stock server's answer
    assert answers[1:] == (split[1][0], split[2][0])  # mlx-vlm resumed at the same splits
    # the split at b shows in the tiny Qwen3.5's numerics (not in the tiny Gemma 3's)
    assert (answers[1] != uncached[1][0]) == (family == "qwen3_5")
    points = [
        (s["mlxcache"]["branch_points"], s["mlxcache"]["branch_points_stored"]) for s in stats
    ]
    if family == "gemma3":  # no state layers: no branch point looked for, no split added
        assert points == [(0, 0), (0, 0)] and "branches off" not in first.log()
        return
    assert points == [(1, 1), (0, 0)]  # the third request resumed at the branch point
    line = f"branches off a stored one at {b} of {len(prompts[1])} tokens ({hit} restored)"
    assert line in first.log() and "branches off" not in second.log()
