"""Put/get throughput of a realistic KV cache through each backend, against baselines.

Every baseline runs in the same process, on the same arrays (or the same byte count), right
next to the operation it judges. Ratios are ``baseline time / our time`` (> 1 = we are faster).
"""

from __future__ import annotations

import gc
import os
import pickle  # baseline only: mlxcache itself never pickles
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from benchmarks.common import (
    Row,
    Stats,
    evaluate,
    fsync_file,
    have,
    kv_arrays,
    payload_bytes,
    speed_ratio,
    time_alternating,
    time_runs,
)
from mlxcache import Record, open_backend
from mlxcache.records import format as st

SECTION = "throughput"
CHUNK = 64 * 2**20  # dd-style block size
REDIS_MAX_STRING = 512 * 2**20  # Redis' default proto-max-bulk-len: raw SETs are split like ours
KEY = "bench-kv"
LARGE_REPEAT = 3


@dataclass
class Context:
    """What every section needs: repeats, a scratch folder, a private Redis and notes."""

    repeat: int
    tmpdir: Path
    redis_url: str | None = None
    smoke: bool = False
    notes: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _raw_write(path: Path, views: list[memoryview]) -> None:
    """dd-style: write the bytes in 64 MiB blocks, fsync, close."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for view in views:
            for start in range(0, len(view), CHUNK):
                os.write(fd, view[start : start + CHUNK])
        os.fsync(fd)
    finally:
        os.close(fd)


def _raw_read(path: Path, dst: np.ndarray) -> None:
    with open(path, "rb", buffering=0) as f:
        view = memoryview(dst)
        got = 0
        while got < len(view):
            n = f.readinto(view[got : got + CHUNK])
            if not n:
                break
            got += n


def _mlx_lm_caches(arrays: dict[str, mx.array], tokens: int) -> list[Any] | None:
    try:
        from mlx_lm.models.cache import KVCache
    except ImportError:
        return None
    caches = []
    layers = len(arrays) // 2
    for layer in range(layers):
        c = KVCache()
        c.state = (arrays[f"layers.{layer}.keys"], arrays[f"layers.{layer}.values"], tokens)
        caches.append(c)
    return caches


class _Sizer:
    """Collects the rows of one size; holds the data every measurement of that size shares."""

    def __init__(self, tokens: int, ctx: Context) -> None:
        self.tokens = tokens
        self.ctx = ctx
        self.arrays = kv_arrays(tokens)
        self.nbytes = payload_bytes(self.arrays)
        # over 1 GB, each run takes seconds: at most LARGE_REPEAT runs keep the benchmark short
        self.repeat = ctx.repeat if self.nbytes < 1e9 else min(ctx.repeat, LARGE_REPEAT)
        self.views = [memoryview(a).cast("B") for a in self.arrays.values()]
        self.record = Record(arrays=self.arrays, meta={"tokens": tokens, "model": "bench"})
        self.caches = _mlx_lm_caches(self.arrays, tokens)
        self.warm = 1 if self.nbytes < 256 * 2**20 else 0  # untimed first run when cheap
        self.rows: list[Row] = []
        self.base: dict[str, Stats] = {}

    def time(self, fn: Any, **kw: Any) -> Stats:
        kw.setdefault("warmup", self.warm)
        return time_runs(fn, self.repeat, **kw)

    def baseline(self, name: str, stats: Stats, note: str = "") -> None:
        self.base[name] = stats
        _debug_rss(name)
        self.rows.append(
            Row(SECTION, name, self.tokens, self.nbytes, "s", stats, note=note, ratio_kind="limit")
        )

    def ours(
        self,
        name: str,
        stats: Stats,
        baseline: str,
        target: float | None = None,
        note: str = "",
        absolute: tuple[str, bool] | None = None,
    ) -> Row:
        ratio = speed_ratio(stats, self.base[baseline]) if baseline in self.base else None
        met = None if target is None or ratio is None else ratio >= target
        text = None if target is None else f">= {target:g}x"
        if absolute is not None:
            text, met = absolute
        row = Row(
            SECTION,
            name,
            self.tokens,
            self.nbytes,
            "s",
            stats,
            baseline=baseline,
            ratio=ratio,
            ratio_kind="speed vs baseline (>1 = faster)",
            target=text,
            met=met,
            note=note,
        )
        self.rows.append(row)
        _debug_rss(name)
        return row

    def check(self, got: Record | None, what: str) -> None:
        """A benchmark of a silent miss would be meaningless: insist on a full round trip."""
        if got is None or sorted(got.arrays) != sorted(self.arrays):
            raise RuntimeError(f"{what}: the stored record did not come back")
        a, b = got.arrays["layers.0.keys"], self.arrays["layers.0.keys"]
        if not mx.array_equal(a.view(mx.uint16), b.view(mx.uint16)).item():
            raise RuntimeError(f"{what}: the stored record came back different")


def _debug_rss(name: str) -> None:
    if os.environ.get("MLXCACHE_BENCH_DEBUG"):
        with open("/proc/self/status") as f:
            mem = [line.split()[1] for line in f if line.startswith(("VmRSS", "VmHWM"))]
        print(f"  {name}: VmHWM {int(mem[0]) >> 10} MiB, VmRSS {int(mem[1]) >> 10} MiB")


def run_size(tokens: int, ctx: Context) -> list[Row]:
    """All throughput rows for one cache size."""
    s = _Sizer(tokens, ctx)
    _memory_rows(s)
    _disk_rows(s)
    if ctx.redis_url:
        _redis_rows(s)
    _serializer_rows(s)
    rows = s.rows
    del s
    gc.collect()
    mx.clear_cache()
    return rows


def _memory_rows(s: _Sizer) -> None:
    """numpy memcpy of the payload's bytes (the limit), then memory:// put/get."""
    src = np.empty(s.nbytes, np.uint8)
    pos = 0
    for v in s.views:
        src[pos : pos + len(v)] = np.frombuffer(v, np.uint8)
        pos += len(v)
    dst = np.ones_like(src)
    s.baseline("numpy memcpy", s.time(lambda d=dst, x=src: np.copyto(d, x), warmup=1))
    del dst, src

    with open_backend("memory://") as mem:
        s.ours("memory:// put", s.time(lambda: mem.put(KEY, s.record)), "numpy memcpy")
        s.check(mem.get(KEY), "memory://")
        many = max(s.repeat, 20)
        call = time_runs(lambda: mem.get(KEY), many, warmup=1, collect=False)
        s.ours(
            "memory:// get (call only)",
            call,
            "numpy memcpy",
            note="arrays not evaluated",
            absolute=("< 100 µs", call.median < 100e-6),
        )
        used = s.time(lambda: evaluate(mem.get(KEY)), warmup=1, collect=False)
        s.ours(
            "memory:// get + eval",
            used,
            "numpy memcpy",
            note="get, then mx.eval of the returned arrays",
            absolute=("< 100 µs", used.median < 100e-6),
        )
        mem.clear()


def _disk_rows(s: _Sizer) -> None:
    """dd-style write+fsync / read, mx.save_safetensors+fsync / mx.load, mlx-lm, file://."""
    tmp = s.ctx.tmpdir
    raw_path = tmp / "raw.bin"
    s.baseline("raw write + fsync (dd)", s.time(lambda: _raw_write(raw_path, s.views), warmup=0))
    dst = np.ones(s.nbytes, np.uint8)
    s.baseline(
        "raw read (page cache)",
        s.time(lambda d=dst: _raw_read(raw_path, d), warmup=1),
        note="file just written: read from the page cache",
    )
    del dst
    _unlink(raw_path)

    sf_path = tmp / "mx.safetensors"

    def mx_save() -> None:
        mx.save_safetensors(str(sf_path), s.arrays)
        fsync_file(sf_path)

    mx_save()
    disk = None
    if have("mlxcache.backends.disk"):
        disk = open_backend(f"file://{tmp / 'store'}")
        disk.put(KEY, s.record)
        s.check(disk.get(KEY), "file://")
    else:
        s.ctx.note("mlxcache.backends.disk had not landed: file:// rows are left out.")
    _allocator_rows(s, disk, mx_save, lambda: evaluate(mx.load(str(sf_path))))
    _unlink(sf_path)

    if s.caches is not None:
        from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

        lm_path = tmp / "mlx_lm.safetensors"
        s.baseline(
            "mlx-lm save_prompt_cache",
            s.time(lambda: save_prompt_cache(str(lm_path), s.caches)),
            note="as shipped: no fsync",
        )

        def lm_save_fsync() -> None:
            save_prompt_cache(str(lm_path), s.caches)
            fsync_file(lm_path)

        s.baseline("mlx-lm save_prompt_cache + fsync", s.time(lm_save_fsync))
        s.baseline(
            "mlx-lm load_prompt_cache + eval",
            s.time(lambda: evaluate(load_prompt_cache(str(lm_path)))),
        )
        _unlink(lm_path)
    else:
        s.ctx.note("mlx-lm is not installed: its save/load_prompt_cache rows are left out.")

    if disk is None:
        return
    try:
        disk.delete(KEY)
        _prompt_cache_rows(s, disk)
    finally:
        disk.clear()
        disk.close()


WARM = "warm allocator"
COLD = "cold allocator"


def _allocator_rows(s: _Sizer, disk: Any, mx_save: Any, mx_load: Any) -> None:
    """mx.save_safetensors + fsync / mx.load + eval against file:// put / get, in alternating
    order, with a warm allocator (MLX's buffer cache kept between runs, as in a server that
    serves the same-size record again and again: the headline) and a cold one (cache emptied
    before every run, so every get page-faults fresh memory)."""
    for mode, clear in ((WARM, False), (COLD, True)):
        suffix = "" if mode == WARM else f", {COLD}"
        puts: dict[str, Any] = {"save": mx_save}
        gets: dict[str, Any] = {"load": mx_load}
        setup: dict[str, Any] = {}
        if disk is not None:
            puts["put"] = lambda: disk.put(KEY, s.record)
            setup["put"] = lambda: disk.delete(KEY)
            gets["get"] = lambda: evaluate(disk.get(KEY))
        put = time_alternating(puts, s.repeat, setup=setup, warmup=1, clear=clear)
        if disk is not None and disk.get(KEY) is None:
            disk.put(KEY, s.record)
        get = time_alternating(gets, s.repeat, warmup=1, clear=clear)
        tag = f"{WARM}; " if mode == WARM else ""
        s.baseline(f"mx.save_safetensors + fsync{suffix}", put["save"], note=tag.rstrip("; "))
        s.baseline(f"mx.load + eval{suffix}", get["load"], note=f"{tag}file in the page cache")
        if disk is None:
            continue
        s.ours(
            f"file:// put{suffix}",
            put["put"],
            f"mx.save_safetensors + fsync{suffix}",
            1.0,
            note=tag.rstrip("; "),
        )
        s.ours(
            f"file:// get{suffix}",
            get["get"],
            f"mx.load + eval{suffix}",
            1.0,
            note=f"{tag}checksum verified",
        )


def _serializer_rows(s: _Sizer) -> None:
    """The serializer alone against pickle, in memory, on the same arrays."""
    s.baseline(
        "pickle.dumps (numpy views)",
        s.time(lambda: pickle.dumps(_numpy_views(s.arrays), protocol=5)),
    )
    pickled = pickle.dumps(_numpy_views(s.arrays), protocol=5)
    s.baseline("pickle.loads", s.time(lambda p=pickled: pickle.loads(p)))
    del pickled
    s.ours(
        "safetensors.to_bytes",
        s.time(lambda: st.to_bytes(s.record)),
        "pickle.dumps (numpy views)",
        note="includes the xxh3 checksum",
    )
    blob = st.to_bytes(s.record)
    s.ours(
        "safetensors.from_bytes",
        s.time(lambda: evaluate(st.from_bytes(blob))),
        "pickle.loads",
        note="verifies the checksum and builds mx arrays",
    )


def _numpy_views(arrays: dict[str, mx.array]) -> dict[str, np.ndarray]:
    return {k: np.frombuffer(memoryview(a).cast("B"), np.uint16) for k, a in arrays.items()}


def _prompt_cache_rows(s: _Sizer, backend: Any) -> None:
    """dump_prompt_cache + put / get + load_prompt_cache, against mlx-lm's own functions."""
    if s.caches is None:
        return
    if not have("mlxcache.serializers.prompt_cache"):
        s.ctx.note(
            "mlxcache.serializers.prompt_cache had not landed: prompt-cache rows are left out."
        )
        return
    from mlxcache.serializers.prompt_cache import dump_prompt_cache, load_prompt_cache

    key = KEY + "-pc"
    put = s.time(
        lambda: backend.put(key, dump_prompt_cache(s.caches)),
        setup=lambda: backend.delete(key),
        warmup=0,
    )
    fair = s.base.get("mlx-lm save_prompt_cache + fsync")
    note = "dump_prompt_cache + put"
    if fair:
        note += f"; vs mlx-lm + fsync: {speed_ratio(put, fair):.2f}x"
    s.ours("file:// put prompt cache", put, "mlx-lm save_prompt_cache", 1.0, note=note)
    s.ours(
        "file:// get prompt cache",
        s.time(lambda: evaluate(load_prompt_cache(backend.get(key)))),
        "mlx-lm load_prompt_cache + eval",
        1.0,
        note="get + load_prompt_cache + eval",
    )
    backend.delete(key)


def _redis_rows(s: _Sizer) -> None:
    """Raw redis-py SET/GET of the same byte count, then redis:// put/get."""
    _raw_redis_rows(s)
    if not have("mlxcache.backends.redis"):
        s.ctx.note("mlxcache.backends.redis had not landed: redis:// rows are left out.")
        return
    # a 1.9 GB value takes seconds to move: a long socket timeout, like the raw client's
    with open_backend(s.ctx.redis_url + "?timeout=300") as backend:
        s.ours(
            "redis:// put",
            s.time(lambda: backend.put(KEY, s.record), setup=lambda: backend.delete(KEY)),
            "redis-py SET (raw)",
            0.7,
        )
        s.check(backend.get(KEY), "redis://")
        s.ours(
            "redis:// get",
            s.time(lambda: evaluate(backend.get(KEY))),
            "redis-py GET (raw)",
            0.7,
        )
        backend.clear()


def _raw_redis_rows(s: _Sizer) -> None:
    import redis

    client = redis.Redis.from_url(s.ctx.redis_url, socket_timeout=300)
    data = b"".join(s.views)  # one bytes object, as a client would hold a value
    if len(data) <= REDIS_MAX_STRING:
        chunks: list[bytes | memoryview] = [data]
    else:  # over Redis' string limit: 512 MiB slices, sent in one MULTI
        view = memoryview(data)
        chunks = [view[i : i + REDIS_MAX_STRING] for i in range(0, len(data), REDIS_MAX_STRING)]
    keys = [f"raw:{i}" for i in range(len(chunks))]

    def raw_set() -> None:
        if len(chunks) == 1:
            client.set(keys[0], chunks[0])
            return
        pipe = client.pipeline(transaction=True)
        for k, c in zip(keys, chunks, strict=True):
            pipe.set(k, c)
        pipe.execute()

    def raw_get() -> None:
        if len(chunks) == 1:
            client.get(keys[0])
            return
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.get(k)
        pipe.execute()

    split = "split in 512 MiB strings, one MULTI" if len(chunks) > 1 else ""
    s.baseline("redis-py SET (raw)", s.time(raw_set), note=split)
    s.baseline("redis-py GET (raw)", s.time(raw_get), note=split)
    client.delete(*keys)
    client.close()


def run(sizes: list[int], ctx: Context) -> list[Row]:
    rows: list[Row] = []
    for tokens in sizes:
        rows += run_size(tokens, ctx)
    return rows
