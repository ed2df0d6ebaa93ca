"""Load and faults: two ``mlxcache serve`` workers on one shared store, under concurrent clients,
while the store and a worker are killed, or the disk fills up.

Each engine of ``serve_fleet.ENGINES`` runs the Redis scenario (mlx-vlm with images, vllm-mlx in
its own venv, on fewer requests); the RSS and disk-full scenarios run on mlx-lm only (CI time:
they test the shared cache's code, which every engine runs).
Every answer must equal the answer of the same engine with no cache at all; no request may
fail except one in flight to a worker that was SIGKILLed; once the fault is over, hits resume.
Real parts only: redis-server and the workers are subprocesses, requests are real HTTP.
"""

from __future__ import annotations

import signal
import time

import pytest
from redis_server import RedisServer
from serve_fleet import ENGINES, Load, Worker, start_workers

PROMPTS = 4  # distinct prompts (they share a system prompt: partial hits too)
NEW = range(PROMPTS, 2 * PROMPTS)  # prompts first sent while the store is failing
HEAL = 2 * PROMPTS  # sent only to the healer, before Redis dies (then hot there alone)
MAX_TOKENS = 4
# mlx-lm only: the scenarios that test the shared cache's code rather than an engine's seam
LM_ONLY = pytest.mark.parametrize("engine", ["mlx-lm"], indirect=True)


@pytest.fixture(params=sorted(ENGINES), scope="module")
def engine(request):
    return ENGINES[request.param]


@pytest.fixture(scope="module")
def model(engine, tmp_path_factory):
    return engine.build(tmp_path_factory.mktemp(engine.name))


@pytest.fixture(scope="module")
def uncached(engine, model, tmp_path_factory):
    """Prompt -> the engine's answer without any cache (in this process, or its own server)."""
    prompts = range(2 * PROMPTS)
    folder = tmp_path_factory.mktemp(f"{engine.name}-uncached")
    answers = engine.answers(model, [engine.messages(p) for p in prompts], MAX_TOKENS, folder)
    return dict(zip(prompts, answers, strict=True))


@pytest.fixture
def fleet(request):
    """Starts workers; SIGKILLs every one at the end (their logs are shown if a test fails)."""
    started: list[Worker] = []

    def start(*args, **kwargs) -> list[Worker]:
        workers = start_workers(*args, **kwargs)
        started.extend(workers)
        return workers

    yield start
    for w in started:
        w.kill()


def check(load: Load, uncached: dict[int, str]) -> None:
    """Every answer is the uncached one; only requests in flight to a killed worker failed."""
    wrong = [a for a in load.answers if a.error is None and a.text != uncached[a.prompt]]
    assert not wrong, f"{len(wrong)} wrong answers, e.g. {wrong[0]}"
    assert not load.failures(), f"failed requests: {load.failures()[:3]}"
    assert sum(a.error is None for a in load.answers) >= len(load.answers) - 4 * len(load.workers)
    for w in load.workers:  # a store failure is a log line, never an exception
        assert "Traceback" not in w.log(), w.log()[-3000:]


def recomputed(answers: list) -> bool:
    """Some of these answers were (partly) computed: the shared store did not have them."""
    return any(a.error is None and a.cached < a.prompt_tokens - 1 for a in answers)


def hits(answers: list) -> bool:
    return any(a.error is None and a.cached == a.prompt_tokens - 1 for a in answers)


def hits_resume(workers: list[Worker], engine, uncached: dict[int, str]) -> None:
    """After the faults: every worker answers every prompt right, from the cache."""
    for w in workers:
        for p in uncached:
            text, n, cached = w.chat(engine.messages(p), MAX_TOKENS)
            assert text == uncached[p] and cached == n - 1, (w.url, p, text, n, cached)


def sigkill(redis: RedisServer) -> None:
    redis.proc.send_signal(signal.SIGKILL)
    redis.proc.wait(30)
    redis.proc = None


def heal_started(engine, model, fleet, url: str, folder) -> tuple[Worker, int, str]:
    """The healer: a third worker (the default hot tier) that alone is sent ``HEAL``, once, now:
    a miss, computed, stored in Redis and kept in its hot tier. (healer, tokens, text)"""
    folder.mkdir()
    (healer,) = fleet(engine, model, url, folder, n=1)
    (want,) = engine.answers(model, [engine.messages(HEAL)], MAX_TOKENS, folder)
    text, n, cached = healer.chat(engine.messages(HEAL), MAX_TOKENS)
    assert (text, cached) == (want, 0)
    return healer, n, want


def heals(engine, healer: Worker, n: int, want: str, other: Worker, redis) -> None:
    """Redis restarted empty since ``HEAL`` was stored: the healer's next hit of it (from its
    hot tier, nothing recomputed) writes back the records Redis lost, so ``other``, a worker
    that never saw the prompt, hits all of it in Redis instead of computing it. (mlx-lm's
    server: the store after each answer writes what the backend lacks; its LRU is the hot
    tier, so prefix/heal.py's write-back on a PrefixCache hot hit is not the path here.)"""
    healer.chat(engine.messages(0), MAX_TOKENS)  # its Redis client reconnects (a hit)
    with redis.client() as c:
        before = c.dbsize()
        assert (healer.chat(engine.messages(HEAL), MAX_TOKENS)) == (want, n, n - 1)  # hot hit
        deadline = time.monotonic() + 20
        while c.dbsize() == before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.dbsize() > before, "the hot prompt was not written back"
    time.sleep(0.5)  # its last records (a sibling entry) land
    assert other.chat(engine.messages(HEAL), MAX_TOKENS) == (want, n, n - 1)


def test_redis_and_a_worker_killed_under_load(engine, model, uncached, fleet, tmp_path):
    def n(requests: int) -> int:  # the newer engines run a share of the requests (CI time)
        return max(6, round(requests * engine.scale))

    with RedisServer() as redis:
        url = redis.url + "?timeout=0.5"
        if engine.heal_case:
            healer, heal_n, heal_text = heal_started(engine, model, fleet, url, tmp_path / "healer")
        workers = fleet(engine, model, url, tmp_path, flags=engine.hot)
        with Load(workers, range(PROMPTS)) as load:
            warm = load.wait_for(n(40))  # both workers warm: hits from Redis and their hot tiers
            sigkill(redis)  # Redis dies with everything it held
            down = load.wait_for(n(20), seconds=2)  # answered uncached or from the hot tiers
            errors = sum(w.metrics().get("mlxcache_backend_errors_total", 0) for w in workers)
            redis.start()  # the same port, empty (no persistence)
            load.prompts = [*range(PROMPTS), *NEW]  # and new prompts come
            back = load.wait_for(n(20), seconds=1)
            workers[1].restart()  # SIGKILLed mid-request, started again on its port
            load.wait_for(n(40))
        check(load, uncached)
        assert errors > 0  # Redis was really gone: the workers counted its failures
        if engine.hot:  # ... and, with a hot tier of about one entry, recomputed prompts
            assert recomputed(load.answers[warm:down])
        assert hits(load.answers[:warm]) and hits(load.answers[back:])
        restarted = [a for a in load.answers if a.worker == 1 and a.generation == 1]
        assert restarted and all(a.error is None for a in restarted)
        hits_resume(workers, engine, uncached)
        with redis.client() as c:
            assert c.dbsize() > 0  # the empty Redis was filled again
        # the restarted worker (a new process) found prompts in the refilled Redis
        assert workers[1].metrics()["mlxcache_backend_hits_total"] > 0
        if engine.heal_case:  # healing: a prompt hot on the healer only becomes a hit elsewhere
            heals(engine, healer, heal_n, heal_text, workers[1], redis)
            assert "Traceback" not in healer.log(), healer.log()[-3000:]


@LM_ONLY
def test_a_workers_rss_and_fds_stay_flat_over_hundreds_of_requests(
    engine, model, uncached, fleet, tmp_path
):
    """Each request moves about 120 KB of KV (lookup, restore, store, hot-tier churn): a leak of
    a fraction of it per request would grow RSS by well over the bound in 300 requests."""
    with RedisServer() as redis:
        (worker,) = fleet(engine, model, redis.url, tmp_path, n=1, flags=engine.hot)
        with Load([worker], range(2 * PROMPTS)) as load:
            load.wait_for(100)  # warm: every prompt stored, allocator and MLX caches filled
            rss, fds = worker.rss_bytes(), worker.open_fds()
            load.wait_for(300)
            grown, fds_after = worker.rss_bytes() - rss, worker.open_fds()
        check(load, uncached)
        assert grown < 12 * 2**20, f"RSS grew {grown / 2**20:.1f} MiB in 300 requests"
        assert fds_after <= fds + 4, (fds, fds_after)


@LM_ONLY
def test_disk_fills_up_under_load_on_file_cache(engine, model, uncached, fleet, tmp_path):
    workers = fleet(engine, model, f"file://{tmp_path / 'cache'}", tmp_path, flags=engine.hot)
    with Load(workers, range(PROMPTS)) as load:
        load.wait_for(40)
        for w in workers:  # the disk is full: no file of theirs may grow
            w.limit_file_size(0)
        load.prompts = [*range(PROMPTS), *NEW]  # and new prompts come that cannot be stored
        full = load.wait_for(20, seconds=1)
        workers[1].restart()  # a worker started on the full disk
        load.wait_for(20, seconds=1)
        assert sum(w.metrics()["mlxcache_backend_errors_total"] for w in workers) > 0
        for w in workers:  # space again
            w.limit_file_size(None)
        load.wait_for(40)
    check(load, uncached)
    assert recomputed([a for a in load.answers[full:] if a.prompt in NEW])
    hits_resume(workers, engine, uncached)
    workers[0].restart()  # a new process: every prompt, the new ones too, from the folder
    hits_resume(workers[:1], engine, uncached)
