"""Shared helpers: timing, result rows, the benchmark KV cache and machine facts."""

from __future__ import annotations

import gc
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import mlx.core as mx

# Realistic KV cache shape (a 7B-class model with GQA): 28 layers, 8 KV heads, head dim 128, bf16.
LAYERS = 28
KV_HEADS = 8
HEAD_DIM = 128
BYTES_PER_TOKEN = LAYERS * 2 * KV_HEADS * HEAD_DIM * 2  # keys + values, 2 bytes each


@dataclass
class Stats:
    """Median and spread of repeated measurements (seconds, bytes or ratios)."""

    median: float
    min: float
    max: float
    q1: float
    q3: float
    runs: int

    @classmethod
    def of(cls, values: list[float]) -> Stats:
        vals = sorted(values)
        if len(vals) >= 2:
            q1, _, q3 = statistics.quantiles(vals, n=4, method="inclusive")
        else:
            q1 = q3 = vals[0]
        return cls(statistics.median(vals), vals[0], vals[-1], q1, q3, len(vals))


@dataclass
class Row:
    """One line of the report; ``ratio`` is framed so that > 1 is better (see ``ratio_kind``)."""

    section: str
    name: str
    tokens: int | None = None
    nbytes: int | None = None
    unit: str = "s"
    stats: Stats | None = None
    baseline: str | None = None
    ratio: float | None = None
    ratio_kind: str = ""
    target: str | None = None
    met: bool | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def gbps(self) -> float | None:
        if self.unit != "s" or not self.nbytes or not self.stats or self.stats.median <= 0:
            return None
        return self.nbytes / self.stats.median / 1e9


def time_runs(
    fn: Callable[[], Any],
    repeat: int,
    *,
    setup: Callable[[], Any] | None = None,
    teardown: Callable[[], Any] | None = None,
    warmup: int = 0,
    collect: bool = True,
    clear: bool = True,
) -> Stats:
    """Time ``fn`` ``repeat`` times (after ``warmup`` untimed runs); setup/teardown untimed.

    The garbage collector is paused while ``fn`` runs; ``collect`` runs it before each call
    (skip it for microsecond operations: a full collection costs tens of milliseconds).
    ``clear`` empties MLX's buffer cache after each run (a *cold allocator*: the next run
    page-faults fresh memory); ``clear=False`` keeps it, as a long-running server does.
    """
    times: list[float] = []
    for i in range(warmup + repeat):
        if setup is not None:
            setup()
        if collect:
            gc.collect()
        gc.disable()
        try:
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
        finally:
            gc.enable()
        if teardown is not None:
            teardown()
        if clear:
            mx.clear_cache()  # freed buffers go back to the system, not to MLX's cache
        if i >= warmup:
            times.append(dt)
    return Stats.of(times)


def time_alternating(
    fns: dict[str, Callable[[], Any]],
    repeat: int,
    *,
    setup: dict[str, Callable[[], Any]] | None = None,
    warmup: int = 1,
    clear: bool = True,
) -> dict[str, Stats]:
    """Time several functions in alternating order (ABBA...), so drift hits each alike."""
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    setup = setup or {}
    for i in range(warmup + repeat):
        order = names if i % 2 == 0 else names[::-1]
        for name in order:
            if name in setup:
                setup[name]()
            gc.collect()
            gc.disable()
            try:
                t0 = time.perf_counter()
                fns[name]()
                dt = time.perf_counter() - t0
            finally:
                gc.enable()
            if clear:
                mx.clear_cache()
            if i >= warmup:
                times[name].append(dt)
    return {n: Stats.of(t) for n, t in times.items()}


def speed_ratio(ours: Stats, baseline: Stats) -> float:
    """Baseline time / our time: our speed as a fraction of the baseline's (> 1 = faster)."""
    return baseline.median / ours.median if ours.median > 0 else float("inf")


def kv_arrays(tokens: int, seed: int = 0) -> dict[str, mx.array]:
    """Evaluated bf16 keys/values, one pair per layer, shape (1, heads, tokens, dim).

    One random tensor, scaled and shifted differently per array: distinct, realistic values at
    a fraction of the cost of drawing 1.9 GB of normals on a CPU.
    """
    mx.random.seed(seed)
    base = mx.random.normal((1, KV_HEADS, tokens, HEAD_DIM), dtype=mx.bfloat16)
    out: dict[str, mx.array] = {}
    i = 0
    for layer in range(LAYERS):
        for part in ("keys", "values"):
            a = base * (1 + i / 64) + i / 8
            mx.eval(a)
            out[f"layers.{layer}.{part}"] = a
            i += 1
    return out


def kv_cache(
    tokens: int,
    layers: int,
    kv_heads: int,
    head_dim: int,
    seed: int = 0,
    scales: tuple[int, int, float] = (32, 64, 0.5),
) -> list[Any]:
    """``layers`` evaluated mlx-lm KVCache layers of ``tokens`` random bf16 keys/values; layer
    ``i`` holds ``base * (1 + i / a)`` and ``base * (1 - i / b) + c`` for ``scales`` (a, b, c)."""
    from mlx_lm.models.cache import KVCache

    a, b, shift = scales
    mx.random.seed(seed)
    base = mx.random.normal((1, kv_heads, tokens, head_dim), dtype=mx.bfloat16)
    out = []
    for i in range(layers):
        c = KVCache()
        k, v = base * (1 + i / a), base * (1 - i / b) + shift
        mx.eval(k, v)
        c.state = (k, v, tokens)
        out.append(c)
    return out


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush a written file to the disk (the baselines' ``+ fsync``: as durable as our puts)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def payload_bytes(arrays: dict[str, mx.array]) -> int:
    return sum(a.nbytes for a in arrays.values())


def evaluate(obj: Any) -> None:
    """Force every mx.array reachable in dicts, lists, tuples and cache objects."""
    found: list[mx.array] = []

    def walk(x: Any) -> None:
        if isinstance(x, mx.array):
            found.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list | tuple):
            for v in x:
                walk(v)
        elif hasattr(x, "arrays") and isinstance(x.arrays, dict):  # Record
            walk(x.arrays)
        elif hasattr(x, "keys") and isinstance(getattr(x, "keys", None), mx.array):  # KV cache
            walk([x.keys, x.values])

    walk(obj)
    if found:
        mx.eval(found)


def machine_info() -> dict[str, Any]:
    """nproc, memory, CPU model, Python / mlx / mlx-lm / redis versions."""
    info: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_device": str(mx.default_device()),
    }
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    info["mem_gib"] = round(int(line.split()[1]) / 2**20, 1)
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    for mod in ("mlx_lm", "mlx_vlm", "redis", "numpy"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:
            info[mod] = None
    try:
        import hiredis  # noqa: F401

        info["hiredis"] = True
    except ImportError:
        info["hiredis"] = False
    return info


def human_bytes(n: int | None) -> str:
    if n is None:
        return ""
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:.3g} {unit}"
    return f"{n} B"


def human_time(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


def have(module: str) -> bool:
    """Whether ``module`` imports (used to skip rows for parts that have not landed)."""
    try:
        __import__(module)
    except Exception:
        return False
    return True
