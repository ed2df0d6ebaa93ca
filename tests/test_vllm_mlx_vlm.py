"""``mlxcache serve --engine vllm-mlx --mllm``: vllm-mlx's server with a tiny VLM, real HTTP.

Images travel as base64 data URLs. Every answer is compared with vllm-mlx's own server with
its caches off (the batched path's vision cache cannot be turned off, so each reference answer
comes from a server that has not seen a colliding request). The servers run in the vllm-mlx
venv (see test_vllm_mlx_server.py).
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image
from sdk_clients import Clients, messages, png_b64, usage_seen
from vllm_servers import NAME, Server, require_vllm_python, starter

from mlxcache.tiny_models import build_tiny_vlm

QUESTION = "What is in the picture? Count the shapes."


def _data_url(pixels: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


IMAGE_A = _data_url(np.zeros((56, 56, 3), np.uint8))
IMAGE_B = _data_url(np.stack([np.tile(np.linspace(0, 255, 56).astype(np.uint8), (56, 1))] * 3, -1))
CASES = {
    "A": [IMAGE_A],
    "B": [IMAGE_B],
    "AB": [IMAGE_A, IMAGE_B],
    "BA": [IMAGE_B, IMAGE_A],
}


def _messages(images: list[str]) -> list[dict]:
    content = [{"type": "image_url", "image_url": {"url": u}} for u in images]
    return [{"role": "user", "content": [*content, {"type": "text", "text": QUESTION}]}]


@pytest.fixture(scope="module")
def vllm_python() -> str:
    return require_vllm_python()


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory) -> str:
    return str(build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny"))


@pytest.fixture
def vlm_servers(tmp_path, vllm_python, tiny_vlm):
    yield from starter(vllm_python, tiny_vlm, tmp_path, "--mllm")


def _ask(server: Server, case: str, **salt: str) -> tuple[str, int, int | None]:
    return server.chat(_messages(CASES[case]), max_tokens=16, **salt)


def _hits(server: Server, case: str | None, **salt: str) -> tuple[str, int]:
    """The answer to ``case`` (None: a text-only prompt) and how many hits it made in the
    vision cache (the prefix cache for text)."""
    cache, field = ("prefix_cache", "hits") if case is None else ("vision_embedding_cache",
                                                                  "pixel_cache_hits")  # fmt: skip

    def hits() -> int:
        return server.get("/v1/cache/stats")["engine_cache"][cache][field]

    before = hits()
    text = server.chat(**salt)[0] if case is None else _ask(server, case, **salt)[0]
    return text, hits() - before


def test_simple_mode_reuses_an_image_prompt_and_after_a_restart(vlm_servers, tmp_path):
    """(c) simple mode: an image request repeated hits (and truly skips its prefill: all
    but the last token come from the cache), and hits again first thing after SIGKILL."""
    ref = vlm_servers(None, reference=True)
    expected, _, _ = _ask(ref, "A")
    ref.kill()

    cache = f"file://{tmp_path / 'cache'}"
    first = vlm_servers(cache)
    text, prompt_tokens, cached = _ask(first, "A")
    assert (text, cached) == (expected, 0)
    text, _, cached = _ask(first, "A")
    assert (text, cached) == (expected, prompt_tokens - 1)
    # a request's cache_salt (body) or X-Cache-Salt (header): its own entries
    assert _ask(first, "A", salt="alice") == (expected, prompt_tokens, 0)
    assert _ask(first, "A", salt="bob") == (expected, prompt_tokens, 0)
    assert _ask(first, "A", header="bob") == (expected, prompt_tokens, prompt_tokens - 1)
    # both SDKs, streamed or not, default sampling or temperature=0.7/top_p=0.9: cached
    turns = messages(QUESTION, png_b64())
    clients = Clients(first.url, NAME)
    dave = {"extra_body": {"cache_salt": "dave"}}  # streamed: the same
    assert [clients.openai_stream(_messages(CASES["A"]), dave) for _ in range(2)] == [
        (prompt_tokens, 0),
        (prompt_tokens, prompt_tokens - 1),
    ]
    seen = usage_seen(clients, *turns)
    assert len(seen) == 10 and all(read == n - 1 for n, read in seen.values()), seen
    first.kill()

    second = vlm_servers(cache)
    text, _, cached = _ask(second, "A")
    assert (text, cached) == (expected, prompt_tokens - 1)
    stats = second.get("/v1/cache/stats")["engine_cache"]["mllm_cache"]
    assert stats["mlxcache"]["hits"] == 1 and stats["tokens_saved"] == prompt_tokens - 1
    assert _ask(second, "A", salt="bob") == (expected, prompt_tokens, prompt_tokens - 1)
    assert _ask(second, "A", salt="carol") == (expected, prompt_tokens, 0)
    clients = Clients(second.url, NAME)
    assert clients.openai_stream(turns[0], {"temperature": 0.7, "top_p": 0.9}) == (
        prompt_tokens,
        prompt_tokens - 1,
    )


def test_batched_images_in_order(vlm_servers, tmp_path):
    """(d) --continuous-batching: A, B, [A, B], [B, A] each answered as vllm-mlx answers it
    uncached (vllm-mlx's own vision cache answers [B, A] with [A, B]'s entry), and again by a
    restarted server from the stored vision entries."""
    flags = ("--continuous-batching",)
    ref = vlm_servers(None, *flags, reference=True)
    expected = {case: _ask(ref, case)[0] for case in ("A", "B", "AB")}
    text = ref.chat()[0]  # a text-only prompt (the path's prefix cache)
    ref.kill()
    ref = vlm_servers(None, *flags, reference=True)  # nothing cached: [B, A] its own
    expected["BA"] = _ask(ref, "BA")[0]
    ref.kill()
    assert expected["AB"] != expected["BA"] and expected["A"] != expected["B"]

    cache = f"file://{tmp_path / 'cache'}"
    first = vlm_servers(cache, *flags)
    assert {case: _ask(first, case)[0] for case in CASES} == expected
    # a request's cache_salt (body) or X-Cache-Salt (header): its own vision entries
    assert _hits(first, "A", salt="alice") == (expected["A"], 0)
    assert _hits(first, "A", salt="bob") == (expected["A"], 0)
    assert _hits(first, "A", header="bob") == (expected["A"], 1)
    # text-only requests on this path: their prefix-cache entries are the salt's own too
    salts = ({}, {"salt": "alice"}, {"salt": "bob"}, {"header": "bob"}, {})
    assert [_hits(first, None, **salt) for salt in salts] == [(text, n) for n in (0, 0, 0, 1, 1)]
    first.kill()
    second = vlm_servers(cache, *flags)
    assert {case: _ask(second, case)[0] for case in ("BA", "AB")} == {
        "BA": expected["BA"],
        "AB": expected["AB"],
    }
    vision = second.get("/v1/cache/stats")["engine_cache"]["vision_embedding_cache"]
    assert vision["pixel_cache_hits"] == 2  # both from the entries the first server stored
    assert _hits(second, "A", salt="bob") == (expected["A"], 1)  # stored by the first
    assert _hits(second, "A", salt="carol") == (expected["A"], 0)
    assert _hits(second, None, salt="bob") == (text, 1)  # from the shared tier
    assert _hits(second, None, salt="carol") == (text, 0)
