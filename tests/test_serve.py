"""``mlxcache serve``: mlx-lm's real HTTP server on a persistent, shared prompt cache.

Each test starts ``mlxcache serve`` as a subprocess on a free loopback port with the tiny local
model and talks to it with urllib, as any OpenAI client would.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request

import mlx.core as mx
import openai
import pytest
from helpers import LoggedServer, read_stream, wait_until_healthy
from redis_server import RedisServer, free_port
from sdk_clients import Clients, usage_seen

from mlxcache.tiny_models import build_tiny_lm

CHAT = [{"role": "user", "content": "Tell me a story about a cat, a dog and a bird."}]


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    return str(build_tiny_lm(tmp_path_factory.mktemp("lm") / "tiny"))


class Server(LoggedServer):
    """``mlxcache serve`` in a subprocess (``plain``: mlx-lm's stock ``mlx_lm.server``, no
    mlxcache); its log goes to a file."""

    def __init__(
        self, model: str, cache: str | None, log_path, *extra: str, plain: bool = False, **env: str
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **env)
        command = ["mlx_lm.server"] if plain else ["mlxcache", "serve"]
        args = [sys.executable, "-m", *command, "--model", model]
        args += ["--port", str(self.port), *extra]  # the default address: 127.0.0.1
        args += ["--cache", cache] if cache is not None else []  # else $MLXCACHE_URL
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(args, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        wait_until_healthy(self, "mlx_lm.server" if plain else "mlxcache serve", 120)
        if not plain:
            assert f"mlxcache serve: mlx-lm will listen on {self.url}\n" in self.log()
        assert f"Starting httpd at 127.0.0.1 on port {self.port}" in self.log()

    def chat(
        self,
        messages=CHAT,
        max_tokens: int = 8,
        salt: str | None = None,
        header: str | None = None,
        seed: int | None = None,
    ) -> tuple[str, int, int]:
        """(text, prompt_tokens, cached_tokens) of one non-streaming chat completion; ``salt``
        goes in the body's ``cache_salt``, ``header`` in ``X-Cache-Salt``; with a ``seed``
        mlx-lm serves the request alone (not batched)."""
        body = {"messages": messages, "max_tokens": max_tokens}
        body.update({} if salt is None else {"cache_salt": salt})
        body.update({} if seed is None else {"seed": seed})
        headers = {"Content-Type": "application/json"}
        headers.update({} if header is None else {"X-Cache-Salt": header})
        req = urllib.request.Request(
            self.url + "/v1/chat/completions", data=json.dumps(body).encode(), headers=headers
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.load(r)
        usage = out["usage"]
        text = out["choices"][0]["message"]["content"]
        return text, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]

    def stream_chat(self, messages=CHAT, max_tokens: int = 8) -> tuple[str, int, int]:
        """The same over server-sent events, with the usage chunk at the end."""
        body = {"messages": messages, "max_tokens": max_tokens, "stream": True}
        body["stream_options"] = {"include_usage": True}
        req = urllib.request.Request(
            self.url + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            text, usage = read_stream(r)
        assert usage is not None
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        return text, usage["prompt_tokens"], cached


@pytest.fixture
def servers(tmp_path):
    started: list[Server] = []

    def start(model: str, cache: str | None, *extra: str, **env: str) -> Server:
        s = Server(model, cache, tmp_path / f"server{len(started)}.log", *extra, **env)
        started.append(s)
        return s

    yield start
    for s in started:
        s.kill()


def test_repeat_then_restart_on_file_cache(tiny_lm, servers, tmp_path):
    cache = f"file://{tmp_path}/cache"
    first = servers(tiny_lm, cache)
    cold, n, cached = first.chat()
    assert cached == 0 and n > 10 and cold
    # (a) the same request in the same process: everything but the last prompt token is reused
    again, n2, cached = first.chat()
    assert (again, n2) == (cold, n)
    assert cached == n - 1
    # (b) killed right after answering, restarted on the same folder: warm from the first request
    first.kill()
    second = servers(tiny_lm, cache, HF_HUB_CACHE=str(tmp_path / "no-hf-cache"))
    warm, n3, cached = second.chat()
    assert (warm, n3) == (cold, n)
    assert cached == n - 1
    # a request's cache_salt (body) or X-Cache-Salt: its own blocks, hot and shared tier alike
    assert second.chat(salt="alice") == (cold, n, 0)
    assert second.chat(salt="alice") == (cold, n, n - 1)  # the same salt: its blocks
    assert second.chat(header="alice") == (cold, n, n - 1)  # the header is the same salt
    assert second.chat(salt="bob") == (cold, n, 0)  # another salt: nothing of alice's
    # a new process: it came from the folder, and the line after the lookup says so
    assert (
        f"this request a shared-tier hit ({n - 1} of {n} tokens reused); hot tier 0 entries, "
        "0 bytes (max unbounded); so far: hot hits 0, shared-tier hits 1, misses 0"
    ) in second.log()
    # streamed, the usage chunk reports the same
    assert second.stream_chat() == (cold, n, n - 1)
    # the openai package sees it too, streamed or not, under any sampling settings (mlx-lm's
    # server has no Anthropic Messages API)
    clients = Clients(second.url, tiny_lm)
    seen = usage_seen(clients, CHAT, None)
    assert len(seen) == 4 and all(read == n - 1 for _, read in seen.values()), seen
    # what clients call first: the model list (no Hugging Face cache folder here), and an
    # unknown model is a 404 naming the served one, not a download
    assert [m.id for m in clients.openai.models.list()] == [os.path.realpath(tiny_lm)]
    with pytest.raises(openai.NotFoundError, match=re.escape(f"it serves `{tiny_lm}`")):
        clients.openai.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2)
    # /metrics: Prometheus text, parsed by prometheus_client's own parser
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(second.url + "/metrics", timeout=10) as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    hits = families["mlxcache_prefix_hit_tokens"].samples
    assert sum(s.value for s in hits if s.name.endswith("_total")) >= n - 1
    assert any(s.value > 0 for s in families["mlxcache_fleet_hits"].samples)


def test_two_servers_share_one_redis(tiny_lm, servers, redis_url):
    a = servers(tiny_lm, redis_url)
    b = servers(tiny_lm, redis_url)
    text_a, n, cached = a.chat()
    assert cached == 0
    # (c) the second server never saw this prompt: it reuses what the first computed
    text_b, n_b, cached_b = b.chat()
    assert (text_b, n_b) == (text_a, n)
    assert cached_b == n - 1
    # a follow-up turn sent to the other server reuses the first turn
    follow = CHAT + [
        {"role": "assistant", "content": text_a},
        {"role": "user", "content": "And then?"},
    ]
    text_f, n_f, cached_f = a.chat(follow)
    assert n_f > n and cached_f > 0
    _, _, cached_fb = b.chat(follow)
    assert cached_fb == n_f - 1
    # mlx-lm stores a system prompt as its own segment: a new conversation on the other
    # server that shares it starts from it
    system = {"role": "system", "content": "You are a storyteller who knows the hills and the sea."}
    _, n_s, _ = a.chat([system, {"role": "user", "content": "A story about a cat."}])
    _, n_t, cached_t = b.chat([system, {"role": "user", "content": "Now one about a bird."}])
    assert 0 < cached_t < min(n_s, n_t) - 3


def test_dead_redis_still_answers_uncached(tiny_lm, servers, tmp_path):
    plain = servers(tiny_lm, None, MLXCACHE_URL="memory://")  # --cache defaults to the env
    reference = plain.chat()[0]
    assert "backend=MemoryBackend" in plain.log()
    dead = RedisServer()
    url = dead.url
    dead.close()  # nothing listens there now
    s = servers(tiny_lm, url + "?timeout=0.5")
    text, n, cached = s.chat()
    assert text == reference and cached == 0
    # the hot tier still works in the process
    text2, _, cached2 = s.chat()
    assert text2 == reference and cached2 == n - 1
    assert "unreachable" in s.log() or "failed" in s.log()


def test_hot_tier_holds_prompt_cache_bytes(tiny_lm, servers, tmp_path):
    budget = 40_000  # a few of the tiny model's caches (about 11 KB each at 256 tokens)
    s = servers(tiny_lm, f"file://{tmp_path}/cache", "--prompt-cache-bytes", str(budget))
    prompts = [
        [{"role": "user", "content": f"Story {i}: a cat over {i} hills."}] for i in range(50)
    ]
    for p in prompts:
        s.chat(p, max_tokens=2)
    s.chat([{"role": "user", "content": "one more, to log the state after the last"}], 2)
    line = re.compile(r"hot tier (\d+) entries, (\d+) bytes \(max (\d+) bytes\)")
    seen = [(int(a), int(b), int(c)) for a, b, c in line.findall(s.log())]
    assert len(seen) == 51
    assert all(m == budget and b <= budget for _, b, m in seen)
    assert max(e for e, _, _ in seen) >= 2  # it did hold several entries
    # the first prompts left the hot tier long ago: the shared tier still has them
    _, n, cached = s.chat(prompts[0], max_tokens=2)
    assert cached == n - 1


def test_without_mlx_lm_one_line_says_what_to_install(tiny_lm):
    code = (
        "import sys\n"
        "sys.modules['mlx_lm'] = None  # as if it were not installed\n"
        "from mlxcache.cli import main\n"
        "sys.exit(main(['serve', '--model', sys.argv[1]]))\n"
    )
    run = subprocess.run([sys.executable, "-c", code, tiny_lm], capture_output=True, text=True)
    assert run.returncode == 1
    assert run.stderr.strip().splitlines() == [
        "mlxcache: error: mlxcache serve needs mlx-lm: pip install 'mlxcache[lm]'"
    ]


def test_bad_cache_uri_is_one_line(tiny_lm):
    args = [sys.executable, "-m", "mlxcache", "serve", "--cache", "nosuch://x", "--model", tiny_lm]
    run = subprocess.run(args, capture_output=True, text=True)
    assert run.returncode == 1
    assert len(run.stderr.strip().splitlines()) == 1 and "nosuch" in run.stderr


def test_bad_cache_kv_bits_is_one_line(tiny_lm):
    args = [sys.executable, "-m", "mlxcache", "serve", "--cache-kv-bits", "7", "--model", tiny_lm]
    run = subprocess.run(args, capture_output=True, text=True)
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "kv_bits must be one of" in lines[0], run.stderr


def test_cache_kv_bits_stores_quantized_blocks(servers, tmp_path):
    """``--cache-kv-bits 8``: the shared tier holds quantized blocks and a restart reuses them."""
    from mlxcache import open_backend

    model = str(build_tiny_lm(tmp_path / "lm32", hidden_size=128, num_heads=4))  # head dim 32
    uri = f"file://{tmp_path / 'cache'}"
    flags = ("--cache-kv-bits", "8", "--cache-kv-group-size", "32", "--cache-block-size", "16")
    s = servers(model, uri, *flags)
    _, n, cached = s.chat(max_tokens=2)
    assert cached == 0
    s.kill()
    s = servers(model, uri, *flags)  # a new process: only the shared tier has the prompt
    _, n2, cached = s.chat(max_tokens=2)
    assert n2 == n and cached == n - 1
    with open_backend(uri) as b:
        blocks = [r for r in b.get_many(list(b.keys(""))) if r.meta.get("kind") == "block"]
    assert blocks and all(r.meta["kvq"]["bits"] == 8 for r in blocks)
    assert all(r.meta["kvq"]["arrays"] for r in blocks)  # every layer's keys/values quantized


def test_the_end_of_a_response_waits_for_its_store():
    from queue import Queue

    from mlx_lm.models.cache import KVCache

    from mlxcache.integrations.mlx_lm.prompt_cache import SharedPromptCache
    from mlxcache.integrations.mlx_lm.server import _HeldEnd

    cache = SharedPromptCache(backend="memory://")
    q: Queue = Queue()
    held = _HeldEnd(q, cache, timeout=60)
    held.put("a token")
    held.put(None)  # the generation thread ends the response ...
    assert q.get_nowait() == "a token" and q.empty()  # ... but it is held back
    c = KVCache()
    c.update_and_fetch(mx.zeros((1, 1, 3, 4)), mx.zeros((1, 1, 3, 4)))
    cache.insert_cache(("m", None, None), [1, 2, 3], [c])  # ... until its cache is stored
    # the store runs on the writer thread; the end comes once it is done
    assert q.get(timeout=30) is None and len(list(cache.backend.keys(""))) > 0
    # without any insert (a failed request), the end still comes, after the timeout
    held = _HeldEnd(q, SharedPromptCache(backend="memory://"), timeout=0.01)
    held.put(None)
    assert q.get(timeout=30) is None


def test_help_lists_ours_then_mlx_lms_options():
    run = subprocess.run(
        [sys.executable, "-m", "mlxcache", "serve", "--help"], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    ours, theirs = run.stdout.index("--cache CACHE"), run.stdout.index("--prompt-cache-bytes")
    assert ours < theirs and "--model MODEL" in run.stdout


def test_concurrent_requests_are_each_stored_before_they_end(tiny_lm, servers, tmp_path):
    """mlx-lm batches concurrent requests; every answered one is in the store at its end."""
    import threading

    cache = f"file://{tmp_path}/cache"
    first = servers(tiny_lm, cache)
    asks = [[{"role": "user", "content": f"Tale {i} of the hills and the sea."}] for i in range(4)]
    answers: dict[int, tuple[str, int, int]] = {}

    def ask(i: int) -> None:
        answers[i] = first.chat(asks[i], max_tokens=6)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(answers) == [0, 1, 2, 3]
    first.kill()  # right after the last answer
    second = servers(tiny_lm, cache)
    for i in range(4):  # (texts are not compared: batched and single runs may round apart)
        _, n, cached = second.chat(asks[i], max_tokens=6)
        assert n == answers[i][1] and cached == n - 1


def test_a_request_salt_on_completions_and_a_bad_salt(tiny_lm, servers, tmp_path):
    """/v1/completions takes cache_salt too; a salt that is not a string is answered 400."""
    s = servers(tiny_lm, f"file://{tmp_path}/cache")
    bad = urllib.request.Request(
        s.url + "/v1/chat/completions",
        data=json.dumps({"messages": CHAT, "max_tokens": 2, "cache_salt": 7}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(bad, timeout=60)
    assert refused.value.code == 400
    assert "cache_salt must be a string" in refused.value.read().decode()
    text = {"prompt": "Once upon a time a cat, a dog and a bird", "max_tokens": 2}
    for salt, want_cached in (("dave", 0), ("dave", True), ("erin", 0)):
        req = urllib.request.Request(
            s.url + "/v1/completions",
            data=json.dumps({**text, "cache_salt": salt}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            usage = json.load(r)["usage"]
        got = usage["prompt_tokens_details"]["cached_tokens"]
        assert got > 0 if want_cached is True else got == 0, (salt, usage)
