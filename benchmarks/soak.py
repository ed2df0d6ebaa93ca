"""The soak: ``python -m benchmarks --only soak [--minutes 30]`` (not in CI).

Two ``mlxcache serve`` workers (mlx-lm, the tiny local model) on the benchmark's private Redis
with a byte budget, four client threads sending mixed traffic to both at once: a set of
repeated prompts (hits, partial hits on a shared system prompt) and, every sample interval,
a batch of prompts never sent before (misses, stores, evictions under the budget). Every answer
is compared with the engine's answer computed here without a cache.

Reported: requests and errors (failed or wrong answers: must be 0); each worker's RSS and open
file descriptors and Redis' ``used_memory`` at the first sample after warm-up and at the end
(must stay flat: the growth is in the note).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Row, Stats

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from serve_fleet import ENGINES, Load, start_workers  # noqa: E402

SECTION = "soak"
REPEATED = 8  # prompts sent again and again
NEW_PER_SAMPLE = 8  # prompts first sent in each sample interval
MAX_TOKENS = 4
FLAGS = ("--prompt-cache-bytes", "300000")  # a hot tier of about two entries
BUDGET = "8m"  # Redis byte budget: about 60 of the 120 KB prompt caches


def _redis_memory(url: str) -> int:
    import redis

    with redis.Redis.from_url(url) as c:
        return int(c.info("memory")["used_memory"])


def run(ctx: Any, minutes: float) -> list[Row]:
    if not ctx.redis_url:
        ctx.note("the soak needs redis-server: left out.")
        return []
    engine = ENGINES["mlx-lm"]
    model = engine.build(ctx.tmpdir / "soak-lm")
    logs = ctx.tmpdir / "soak-logs"
    logs.mkdir(exist_ok=True)
    uncached: dict[int, str] = {}

    def answer_of(p: int) -> str:
        if p not in uncached:
            (uncached[p],) = engine.answers(model, [engine.messages(p)], MAX_TOKENS, logs)
        return uncached[p]

    for p in range(REPEATED):
        answer_of(p)
    uri = f"{ctx.redis_url}?max_bytes={BUDGET}"
    workers = start_workers(engine, model, uri, logs, flags=FLAGS)
    seconds = max(30.0, minutes * 60)
    interval = max(5.0, seconds / 30)
    samples: list[dict[str, float]] = []
    fresh = REPEATED
    started = time.monotonic()
    try:
        with Load(workers, range(REPEATED), max_tokens=MAX_TOKENS) as load:
            while time.monotonic() - started < seconds:
                batch = list(range(fresh, fresh + NEW_PER_SAMPLE))
                fresh += NEW_PER_SAMPLE
                for p in batch:  # computed here before any worker sees the prompt
                    answer_of(p)
                load.prompts = [*range(REPEATED), *batch]
                time.sleep(interval)
                samples.append(
                    {
                        "t": time.monotonic() - started,
                        "requests": load.count(),
                        "redis": _redis_memory(ctx.redis_url),
                        **{f"rss{i}": w.rss_bytes() for i, w in enumerate(workers)},
                        **{f"fds{i}": w.open_fds() for i, w in enumerate(workers)},
                    }
                )
        answers = load.answers
        evictions = sum(w.metrics().get("mlxcache_backend_evictions_total", 0) for w in workers)
    finally:
        for w in workers:
            w.kill()
    failed = [a for a in answers if a.error is not None]
    wrong = [a for a in answers if a.error is None and a.text != answer_of(a.prompt)]
    hits = sum(a.error is None and a.cached == a.prompt_tokens - 1 for a in answers)
    elapsed = samples[-1]["t"]
    warm = samples[min(2, len(samples) - 1)]  # the first minutes fill caches and allocators
    last = samples[-1]
    note = (
        f"{elapsed / 60:.1f} min, {len(answers)} requests ({len(answers) / elapsed:.1f}/s), "
        f"{hits} full hits, {fresh - REPEATED} new prompts, {int(evictions)} evictions, "
        f"{len(failed)} failed, {len(wrong)} wrong"
    )
    rows = [
        Row(SECTION, "soak: requests", None, None, "requests", Stats.of([len(answers)]),
            note=note),
        Row(SECTION, "soak: errors (failed + wrong answers)", None, None, "errors",
            Stats.of([len(failed) + len(wrong)]), target="0",
            met=not failed and not wrong),
    ]  # fmt: skip

    def flat(name: str, key: str, unit: str, scale: float) -> Row:
        values = [s[key] / scale for s in samples]
        grown = (last[key] - warm[key]) / scale
        return Row(
            SECTION, name, None, None, unit, Stats.of(values),
            note=f"{warm[key] / scale:.1f} at {warm['t'] / 60:.1f} min -> "
            f"{last[key] / scale:.1f} at {last['t'] / 60:.1f} min ({grown:+.1f})",
            extra={"samples": values},
        )  # fmt: skip

    for i in range(len(workers)):
        rows.append(flat(f"soak: worker {i} RSS", f"rss{i}", "MB", 1e6))
        rows.append(flat(f"soak: worker {i} open fds", f"fds{i}", "fds", 1))
    rows.append(flat("soak: Redis used_memory", "redis", "MB", 1e6))
    return rows
