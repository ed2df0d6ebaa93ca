"""``mlxcache serve --engine vllm-mlx``: vllm-mlx's own HTTP server on the shared cache.

vllm-mlx 0.6 pins mlx-lm < 0.32 (the suite runs mlx-lm 0.32) and hard-requires torchvision, so
its servers run in a venv of their own (see vllm_servers.py; scripts/test.sh builds it). This
process only
builds the tiny model, runs redis-server and talks HTTP with urllib, as any client would.
Every answer is compared with vllm-mlx's own server with its prefix cache off.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request

import anthropic
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis_server import free_port
from sdk_clients import Clients, isolated, messages, salted_reads, usage_seen
from vllm_servers import CHAT, NAME, TEXT, Server, require_vllm_python, server_args, starter

from mlxcache.tiny_models import build_tiny_lm


@pytest.fixture(scope="module")
def vllm_python() -> str:
    return require_vllm_python()


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory) -> str:
    return str(build_tiny_lm(tmp_path_factory.mktemp("lm") / "tiny"))


@pytest.fixture
def servers(tmp_path, vllm_python, tiny_lm):
    yield from starter(vllm_python, tiny_lm, tmp_path)


@pytest.fixture(scope="module")
def reference(vllm_python, tiny_lm, tmp_path_factory) -> str:
    """vllm-mlx's own greedy answer to ``CHAT`` with continuous batching, caches off."""
    tmp = tmp_path_factory.mktemp("reference")
    args = [*server_args(vllm_python, tiny_lm, None, True), "--continuous-batching"]
    ref = Server(args, tmp / "server.log", tmp / "home")
    try:
        text, _, cached = ref.chat()
    finally:
        ref.kill()
    assert cached is None  # vllm-mlx as shipped reports no cached tokens
    return text


def test_restart_after_sigkill_reuses_the_prompt(servers, reference, tmp_path):
    """(a) text, --continuous-batching: SIGKILL and restart on file://, the first request
    hits, same answer; vllm-mlx's own stats count it."""
    cache = f"file://{tmp_path / 'cache'}"
    first = servers(cache, "--continuous-batching")
    text, prompt_tokens, cached = first.chat()
    assert (text, cached) == (reference, 0)
    assert prompt_tokens > 128
    # what the openai and anthropic packages see: every API, streamed or not, default
    # sampling or temperature=0.7/top_p=0.9, reports all but the last token as cached
    seen = usage_seen(Clients(first.url, NAME), *messages(TEXT), responses=TEXT)
    assert len(seen) == 14 and all(read == n - 1 for n, read in seen.values()), seen
    assert first.chat(salt="alice") == (reference, prompt_tokens, 0)  # its own blocks
    salted = salted_reads(Clients(first.url, NAME), messages(TEXT)[1], TEXT)  # other APIs
    assert len(salted) == 2 and all(isolated(seen) for seen in salted.values()), salted
    first.kill()

    second = servers(cache, "--continuous-batching")
    text, _, cached = second.chat()
    assert text == reference
    assert cached == prompt_tokens - 1  # all but the last token, which always runs
    stats = second.get("/v1/cache/stats")["engine_cache"]
    assert stats["hits"] == 1 and stats["tokens_saved"] == cached
    assert stats["mlxcache"]["hits"] == 1 and stats["mlxcache"]["lookup_errors"] == 0
    n, read = Clients(second.url, NAME).anthropic_message(messages(TEXT)[1], {})
    assert read == n - 1  # the Messages API's prompt, stored by the first server
    # a salt's blocks stored before the restart are its own after it
    assert second.chat(salt="bob") == (reference, prompt_tokens, 0)
    assert second.chat(header="alice") == (reference, prompt_tokens, prompt_tokens - 1)


def test_simple_mode_caches_text(servers, vllm_python, tiny_lm, tmp_path):
    """vllm-mlx's default mode (no --continuous-batching): text requests reuse the shared
    tier too, reported to both SDKs, after a restart too; the greedy answer is vllm-mlx's."""
    ref = Server(server_args(vllm_python, tiny_lm, None, True), tmp_path / "ref.log",
                 tmp_path / "ref")  # fmt: skip
    try:
        expected, prompt_tokens, cached = ref.chat()
    finally:
        ref.kill()
    assert cached is None and prompt_tokens > 128  # vllm-mlx as shipped: nothing reported
    cache = f"file://{tmp_path / 'cache'}"
    first = servers(cache)
    assert first.chat() == (expected, prompt_tokens, 0)
    assert first.chat() == (expected, prompt_tokens, prompt_tokens - 1)
    # a request's cache_salt (body) or X-Cache-Salt (header): its own entries, hot and shared
    assert first.chat(salt="alice") == (expected, prompt_tokens, 0)
    assert first.chat(salt="bob") == (expected, prompt_tokens, 0)
    assert first.chat(header="bob") == (expected, prompt_tokens, prompt_tokens - 1)
    clients = Clients(first.url, NAME)
    dave = {"extra_body": {"cache_salt": "dave"}}  # streamed: the same
    assert [clients.openai_stream(CHAT, dave) for _ in range(2)] == [
        (prompt_tokens, 0),
        (prompt_tokens, prompt_tokens - 1),
    ]
    seen = usage_seen(clients, *messages(TEXT), responses=TEXT)
    assert len(seen) == 14 and all(read == n - 1 for n, read in seen.values()), seen
    salted = salted_reads(clients, messages(TEXT)[1], TEXT)  # salts on the other APIs
    assert len(salted) == 2 and all(isolated(seen) for seen in salted.values()), salted
    first.kill()
    second = servers(cache)
    assert second.chat() == (expected, prompt_tokens, prompt_tokens - 1)
    assert second.chat(salt="bob") == (expected, prompt_tokens, prompt_tokens - 1)  # stored
    assert second.chat(salt="carol") == (expected, prompt_tokens, 0)
    # vllm-mlx's own system-prompt KV snapshots are the salt's own too; on another user turn
    # the snapshot is the longest prefix held, and its tokens are reported
    asks = (("alice", "hello"), ("bob", "hello"), ("bob", "goodbye"))
    got = [second.chat([{"role": "system", "content": TEXT}, {"role": "user", "content": user}],
                       salt=salt) for salt, user in asks]  # fmt: skip
    counters = second.get("/v1/cache/stats")["engine_cache"]["system_kv_cache"]["counters"]
    assert (counters["misses"], counters["hits"]) == (2, 1), counters
    snapshot = re.findall(r"System KV cache HIT \(stream_chat\): reusing (\d+)", second.log())
    assert got[2][2] == int(snapshot[-1]) > 0
    clients = Clients(second.url, NAME)
    n, read = clients.anthropic_stream(messages(TEXT)[1], {})[0]
    assert read == n - 1
    # an unknown model: a 404 naming the served one (vllm-mlx's own check), nothing loads
    with pytest.raises(openai.NotFoundError) as openai_error:
        clients.openai.chat.completions.create(model="gpt-4o", messages=[], max_tokens=2)
    with pytest.raises(anthropic.NotFoundError) as anthropic_error:
        clients.anthropic.messages.create(model="gpt-4o", messages=[], max_tokens=2)
    for error in (openai_error.value, anthropic_error.value):
        assert f"Available model: `{NAME}`" in error.response.text


def test_repeat_in_one_process_reuses_the_prompt(servers, reference, tmp_path):
    """vllm-mlx's scheduler prefills an exact in-memory match in full; the shared tier gives
    it all but the last token instead."""
    s = servers(f"file://{tmp_path / 'cache'}", "--continuous-batching")
    first, prompt_tokens, _ = s.chat()
    second, _, cached = s.chat()
    assert first == second == reference
    assert cached == prompt_tokens - 1
    # a request's cache_salt (body) or X-Cache-Salt (header): its own blocks, in vllm-mlx's
    # in-process LRU and in the shared tier; the same answer
    assert s.chat(salt="alice") == (reference, prompt_tokens, 0)
    assert s.chat(header="alice") == (reference, prompt_tokens, prompt_tokens - 1)
    assert s.chat(salt="bob") == (reference, prompt_tokens, 0)
    assert s.chat(salt="bob") == (reference, prompt_tokens, prompt_tokens - 1)
    assert s.chat() == (reference, prompt_tokens, prompt_tokens - 1)  # unsalted: still its own
    with pytest.raises(urllib.error.HTTPError) as refused:
        s.chat(salt="carol", header="dave")
    assert refused.value.code == 400
    cached = []  # completions too
    for salt in ("erin", "erin", "frank"):
        body = {"model": NAME, "prompt": TEXT, "max_tokens": 4, "temperature": 0.0}
        usage = s.post("/v1/completions", {**body, "cache_salt": salt})["usage"]
        cached.append((usage.get("prompt_tokens_details") or {}).get("cached_tokens"))
    assert cached[0] == cached[2] == 0 and cached[1] == usage["prompt_tokens"] - 1, cached


def test_two_live_servers_share_one_redis(servers, reference, redis_url):
    """(b) the second server hits what the first computed, over a real redis-server."""
    a = servers(redis_url, "--continuous-batching")
    b = servers(redis_url, "--continuous-batching")
    text_a, prompt_tokens, cached_a = a.chat()
    text_b, _, cached_b = b.chat()
    assert text_a == text_b == reference
    assert (cached_a, cached_b) == (0, prompt_tokens - 1)


def test_dead_redis_answers_uncached(servers, reference):
    """(e) nothing listens on the Redis port: correct answers, no HTTP errors."""
    s = servers(f"redis://127.0.0.1:{free_port()}/0", "--continuous-batching")
    for _ in range(2):
        text, _, _ = s.chat()
        assert text == reference
    tier = s.get("/v1/cache/stats")["engine_cache"]["mlxcache"]
    assert tier["hits"] == 0 and tier["tokens_stored"] == 0  # every put failed: a miss
    with urllib.request.urlopen(s.url + "/metrics", timeout=30) as r:
        assert b"mlxcache_backend_errors_total" in r.read()


def test_metrics_and_models_answer(servers, tmp_path):
    s = servers(f"file://{tmp_path / 'cache'}", "--continuous-batching")
    s.chat()
    with urllib.request.urlopen(s.url + "/metrics", timeout=30) as r:
        body = r.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(body)}
    written = families["mlxcache_prefix_stored_tokens"].samples
    assert sum(x.value for x in written if x.name.endswith("_total")) > 0
    timed = families["mlxcache_prefix_store_seconds"].samples
    assert sum(x.value for x in timed if x.name.endswith("_count")) >= 1
    for op in ("lookup", "store"):  # nothing failed: the folder is there
        (failed,) = families[f"mlxcache_serve_{op}_errors"].samples
        assert (failed.labels, failed.value) == ({"engine": "vllm-mlx"}, 0)
    assert s.get("/v1/models")["data"]


def _serve(python: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [python, "-m", "mlxcache", "serve", "--engine", "vllm-mlx", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )


def test_bad_cache_uri_is_one_line_before_any_port(vllm_python, tiny_lm):
    port = free_port()
    run = _serve(vllm_python, "--model", tiny_lm, "--cache", "nosuch://x", "--port", str(port))
    assert run.returncode == 1
    assert len(run.stderr.strip().splitlines()) == 1 and "nosuch" in run.stderr, run.stderr


def test_without_vllm_mlx_one_line_says_what_to_install(tiny_lm):
    """This venv (the suite's) has no vllm-mlx: one line, exit 1, no model loaded."""
    run = _serve(sys.executable, "--model", tiny_lm)
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "vllm-mlx is not installed" in lines[0], run.stderr


UNINSTALL = """
import importlib, json
from starlette.applications import Starlette
from mlxcache.integrations.vllm_mlx import engine_salts, mllm_salts, salts, seam
NAMES = {
    "vllm_mlx.engine_core": ["Request"],
    "vllm_mlx.scheduler": ["MemoryAwarePrefixCache", "Scheduler.add_request",
                           "Scheduler._cleanup_finished", "Scheduler.remove_finished_request"],
    "vllm_mlx.mllm_scheduler": ["MLLMScheduler.add_request", "MLLMScheduler._schedule_waiting",
                                "MLLMScheduler._cleanup_finished",
                                "MLLMScheduler.remove_finished_request", "MLLMScheduler.step"],
    "vllm_mlx.mllm_batch_generator": ["MemoryAwarePrefixCache", "VisionEmbeddingCache",
                                      "is_text_only_prefix_cache_request",
                                      "MLLMBatchGenerator._preprocess_request"],
    "vllm_mlx.engine.simple": ["SimpleEngine.__init__", "SimpleEngine.chat",
                               "SimpleEngine._submit_to_generation_worker",
                               "SimpleEngine._run_blocking_serialized",
                               "SimpleEngine._fetch_prefix_trie_cache",
                               "SimpleEngine._peek_prefix_trie_tokens_saved",
                               "SimpleEngine._probe_system_kv_cache_support",
                               "SimpleEngine._stream_chat_impl",
                               "build_system_prompt_cache_prefix"],
    "mlx_lm": ["stream_generate"],
}
def names():
    out = {}
    for module, attrs in NAMES.items():
        for attr in attrs:
            obj = importlib.import_module(module)
            for part in attr.split("."):
                obj = vars(obj)[part]
            out[f"{module}.{attr}"] = obj
    return out
before = names()
seam.install("memory://")
salts.install(Starlette())
engine_salts.install()
mllm_salts.install()
during = names()
salts.uninstall()
seam.uninstall()
after = names()
print(json.dumps([[k for k in before if during[k] is before[k]],
                  [k for k in before if after[k] is not before[k]]]))
"""


def test_uninstall_puts_back_every_name(vllm_python):
    """``seam.install`` and the salts' installs (as ``mlxcache serve`` makes them) replace
    these names; ``salts.uninstall`` and ``seam.uninstall`` put every one back (run in the
    vllm-mlx venv, no model)."""
    run = subprocess.run([vllm_python, "-c", UNINSTALL], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=os.getcwd()))  # fmt: skip
    assert run.returncode == 0, run.stderr
    unchanged, not_restored = json.loads(run.stdout.strip().splitlines()[-1])
    assert unchanged == [] and not_restored == []
