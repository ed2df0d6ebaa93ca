"""``mlxcache serve --engine mlx-vlm``: mlx-vlm's own server on a shared ``file://`` cache.

Real subprocess servers with the tiny local VLM, real HTTP requests with base64 images:
(a) a repeat in one process, (b) a second live server, (c) SIGKILL and restart.
"""

from __future__ import annotations

import re

import anthropic
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sdk_clients import Clients, isolated, messages, salted_reads, usage_seen
from vlm_server import QUESTION, VlmServer, image

from mlxcache.tiny_models import build_tiny_vlm

BLOCK = ("--cache-block-size", "16")


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    return str(build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny"))


def test_repeat_second_server_and_restart(tiny_vlm, tmp_path):
    cache = f"file://{tmp_path}/cache"
    first = VlmServer(tiny_vlm, cache, tmp_path / "first.log", *BLOCK)
    second = None
    try:
        cold, n, cached = first.chat(["A"])
        assert cached == 0 and n > 20 and cold
        # (a) the same image request again in this process: all but the last token reused
        again, n2, cached = first.chat(["A"])
        assert (again, n2) == (cold, n)
        assert cached >= n // 2 and cached == n - 1
        # another image: nothing of A's image prefix is served for it, and the answer differs
        other, _, cached_b = first.chat(["B"])
        assert other != cold and cached_b < n // 2
        # (b) a second live server on the same folder finds what the first stored
        second = VlmServer(tiny_vlm, cache, tmp_path / "second.log", *BLOCK)
        warm, n3, cached = second.chat(["B"])
        assert (warm, n3, cached) == (other, n, n - 1)
        # ...and the first finds what the second stores
        c_text, _, cached = second.chat(["C"])
        assert cached < n // 2
        assert first.chat(["C"]) == (c_text, n, n - 1)
        # /metrics: Prometheus text of the prefix cache, parsed by prometheus_client
        families = {f.name: f for f in text_string_to_metric_families(first.get("/metrics"))}
        hits = families["mlxcache_prefix_hits"].samples
        assert sum(s.value for s in hits if s.name.endswith("_total")) >= 2
        timed = families["mlxcache_prefix_lookup_seconds"].samples
        assert sum(s.value for s in timed if s.name.endswith("_count")) >= 3
        (failed,) = families["mlxcache_serve_lookup_errors"].samples  # none failed
        assert (failed.labels, failed.value) == ({"engine": "mlx-vlm"}, 0)
        # (c) SIGKILL right after answering, restart on the same folder: the first request hits
        first.kill()
        first = VlmServer(tiny_vlm, cache, tmp_path / "restart.log", *BLOCK)
        assert first.chat(["A"]) == (cold, n, n - 1)
        # both SDKs, streamed or not, default sampling or temperature=0.7/top_p=0.9: each
        # API's prompt reported cached (all but its last token)
        clients = Clients(first.url, tiny_vlm)
        seen = usage_seen(clients, *messages(QUESTION, image("A").split(",", 1)[1]))
        assert len(seen) == 10 and all(read == m - 1 for m, read in seen.values()), seen
        with pytest.raises(openai.NotFoundError, match=re.escape(f"it serves `{tiny_vlm}`")):
            clients.openai.chat.completions.create(model="gpt-4o", messages=[], max_tokens=2)
        with pytest.raises(anthropic.NotFoundError, match="gpt-4o"):
            clients.anthropic.messages.create(model="gpt-4o", messages=[], max_tokens=2)
        # (d) a request's cache_salt: nothing unsalted (nor another salt's) is served for it;
        # the same salt, as body field or header, is, in this process and in another
        assert first.chat(["A"], salt="alice") == (cold, n, 0)
        assert first.chat(["A"], header="alice") == (cold, n, n - 1)
        assert first.chat(["A"], salt="bob") == (cold, n, 0)
        assert second.chat(["A"], salt="alice") == (cold, n, n - 1)
        assert second.chat(["A"], salt="carol", header="carol") == (cold, n, 0)
        # ...on the Messages and Responses APIs too
        turn = messages(QUESTION, image("A").split(",", 1)[1])[1]
        salted = salted_reads(clients, turn, QUESTION)
        assert len(salted) == 2 and all(isolated(seen) for seen in salted.values()), salted
        # a salt that is not a string: 400 on every API (chat completions made it a 500)
        bad, hello = {"cache_salt": 5}, [{"role": "user", "content": "hi"}]
        calls = (
            lambda: clients.openai.chat.completions.create(
                model=tiny_vlm, messages=hello, max_tokens=2, extra_body=bad
            ),
            lambda: clients.openai.responses.create(model=tiny_vlm, input="hi", extra_body=bad),
            lambda: clients.anthropic.messages.create(
                model=tiny_vlm, messages=hello, max_tokens=2, extra_body=bad
            ),
        )
        for call in calls:
            with pytest.raises((openai.BadRequestError, anthropic.BadRequestError)) as refused:
                call()
            assert "cache_salt must be a string, got int" in str(refused.value.body)
    finally:
        first.kill()
        if second is not None:
            second.kill()
