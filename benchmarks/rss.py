"""Peak extra memory of one put or get, each measured in a fresh subprocess.

The child builds what it needs (the arrays for a put, an open backend for a get), resets the
kernel's high-water mark (``/proc/self/clear_refs``), runs the operation once and reports
``VmHWM - VmRSS before``. For a put the floor is 0 (the arrays already exist); for a get it is
1.0x when the returned arrays are a new copy (memory:// hands out views: 0). Redis is measured
as configured (hiredis when installed), signed, and with redis-py's pure-Python reply parser;
its rows note the requests one operation sent.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import Row, Stats, have

SECTION = "rss"
TARGET = 1.2
SECRET_VAR = "MLXCACHE_RSS_SECRET"
# Redis variants: the child of "redis-python" cannot import hiredis; "redis-signed" signs.
_REDIS = ("redis", "redis-signed", "redis-python")


def _status_kb() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value = line.split(":", 1)
                    out[key] = int(value.split()[0])
    except OSError:
        pass
    return out


def _reset_peak() -> int:
    """Reset the high-water mark where Linux allows it; return the RSS (kB) to measure from."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kb()["VmRSS"]
    except (OSError, KeyError):  # not Linux: fall back to the lifetime peak so far
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _peak_kb() -> int:
    status = _status_kb()
    if "VmHWM" in status:
        return status["VmHWM"]
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def child(op: str, target: str, tokens: int, uri: str, path: str) -> dict[str, Any]:
    """Run one measured operation in this process; returns kB figures and the payload."""
    import mlx.core as mx

    from benchmarks.common import evaluate, kv_arrays, payload_bytes
    from mlxcache import Record, open_backend

    key = f"rss-{tokens}"
    if target == "redis-raw":
        return _raw_redis(op, tokens, uri)
    sends = _count_sends() if target in _REDIS else None
    backend = open_backend(uri) if target != "mx" else None
    arrays = kv_arrays(tokens) if op == "put" or target == "memory" else None
    nbytes = payload_bytes(arrays) if arrays else 0
    if op == "get" and target == "memory":
        backend.put(key, Record(arrays=arrays))  # the store holds its own reference
        arrays = None
    record = Record(arrays=arrays) if arrays else None
    if sends is not None:
        _ = key in backend  # connects (and loads scripts) first: count only the operation
    gc.collect()
    mx.clear_cache()
    before = _reset_peak()
    if target == "mx":
        if op == "put":
            mx.save_safetensors(path, arrays)
        else:
            result = mx.load(path)
            evaluate(result)
            nbytes = sum(a.nbytes for a in result.values())
    elif op == "put":
        if sends is not None:
            sends.clear()
        backend.put(key, record)
    else:
        if sends is not None:
            sends.clear()
        result = backend.get(key)
        if result is None:
            raise SystemExit(f"{target}: no entry {key!r} to get")
        evaluate(result)
        nbytes = result.nbytes
    peak = _peak_kb()
    return {"before_kb": before, "peak_kb": peak, "payload": nbytes, "sends": len(sends or [])}


def _count_sends() -> list[int]:
    """Count the requests redis-py writes (a pipeline is one; each refill of a stream one)."""
    from redis.connection import Connection

    sent: list[int] = []
    real = Connection.send_packed_command

    def counted(self: Any, command: Any, check_health: bool = True) -> None:
        sent.append(1)
        real(self, command, check_health)

    Connection.send_packed_command = counted  # type: ignore[method-assign]
    return sent


def _raw_redis(op: str, tokens: int, uri: str) -> dict[str, Any]:
    """redis-py SET/GET of the payload's byte count (split like the throughput baseline)."""
    import redis

    from benchmarks.common import BYTES_PER_TOKEN
    from benchmarks.throughput import REDIS_MAX_STRING

    client = redis.Redis.from_url(uri.split("?")[0], socket_timeout=300)
    client.ping()
    nbytes = tokens * BYTES_PER_TOKEN
    n = -(-nbytes // REDIS_MAX_STRING)
    keys = [f"rss-raw:{i}" for i in range(n)]
    data = os.urandom(nbytes) if op == "put" else b""
    before = _reset_peak()
    if op == "put":
        pipe = client.pipeline(transaction=n > 1)
        for i, k in enumerate(keys):
            pipe.set(k, data[i * REDIS_MAX_STRING : (i + 1) * REDIS_MAX_STRING])
        pipe.execute()
    else:
        got = client.mget(keys) if n > 1 else [client.get(keys[0])]
        if any(v is None for v in got):
            raise SystemExit("redis-raw: nothing to get")
    return {"before_kb": before, "peak_kb": _peak_kb(), "payload": nbytes}


def _spawn(op: str, target: str, tokens: int, uri: str, path: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.rss", op, target, str(tokens), uri, path]
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    # glibc would keep freed blocks resident and reuse them, hiding a later allocation: a fixed
    # mmap threshold returns every large block to the kernel when it is freed.
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    env[SECRET_VAR] = "rss-benchmark-secret"
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"rss child {op} {target} failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(sizes: list[int], ctx: Any) -> list[Row]:
    """Extra RSS / payload for put and get on each backend, plus mx.save/mx.load for reference."""
    targets: list[tuple[str, str]] = [("mx", ""), ("memory", "memory://")]
    if have("mlxcache.backends.disk"):
        targets.append(("file", f"file://{ctx.tmpdir / 'rss-store'}"))
    if ctx.redis_url:
        targets.append(("redis-raw", ctx.redis_url))
    if ctx.redis_url and have("mlxcache.backends.redis"):
        targets.append(("redis", ctx.redis_url + "?timeout=300"))
        if not ctx.smoke:
            targets.append(
                ("redis-signed", ctx.redis_url + f"?timeout=300&secret_env={SECRET_VAR}")
            )
            targets.append(("redis-python", ctx.redis_url + "?timeout=300"))
    runs = 1 if ctx.smoke else max(1, min(ctx.repeat, 2))  # deterministic: 2 show it
    rows: list[Row] = []
    sf = str(ctx.tmpdir / "rss.safetensors")
    for tokens in sizes:
        for target, uri in targets:
            for op in ("put", "get"):
                results = [_spawn(op, target, tokens, uri, sf) for _ in range(runs)]
                payload = results[0]["payload"]
                ratios = [max(0, r["peak_kb"] - r["before_kb"]) * 1024 / payload for r in results]
                name = {
                    "mx": "mx.save_safetensors" if op == "put" else "mx.load + eval",
                    "redis-raw": "redis-py SET (raw)" if op == "put" else "redis-py GET (raw)",
                    "memory": f"memory:// {op}",
                    "file": f"file:// {op}",
                    "redis": f"redis:// {op}",
                    "redis-signed": f"signed redis:// {op}",
                    "redis-python": f"redis:// {op} (pure-Python parser)",
                }[target]
                stats = Stats.of(ratios)
                reference = target in ("mx", "redis-raw")
                rows.append(
                    Row(
                        SECTION,
                        name,
                        tokens,
                        payload,
                        "x",
                        stats,
                        ratio=stats.median,
                        ratio_kind="extra RSS / payload (lower is better)",
                        target=None if reference else f"< {TARGET:g}x",
                        met=None if reference else stats.median < TARGET,
                        note="reference" if reference else _note(target, results[0]),
                    )
                )
        if ctx.redis_url:
            import redis

            redis.Redis.from_url(ctx.redis_url).flushdb()
        for target, uri in targets:  # leave no entry behind
            if target == "file":
                from mlxcache import open_backend

                with open_backend(uri) as b:
                    b.clear()
        try:
            os.unlink(sf)
        except FileNotFoundError:
            pass
    return rows


def _note(target: str, result: dict[str, Any]) -> str:
    if target not in _REDIS:
        return ""
    n = result.get("sends", 0)
    return f"{n} request{'s' if n != 1 else ''}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="one peak-RSS measurement (internal)")
    p.add_argument("op", choices=["put", "get"])
    p.add_argument("target", choices=["mx", "memory", "file", "redis-raw", *_REDIS])
    p.add_argument("tokens", type=int)
    p.add_argument("uri")
    p.add_argument("path")
    a = p.parse_args(argv)
    if a.target == "redis-python":
        sys.modules["hiredis"] = None  # type: ignore[assignment]  # redis-py then parses in Python
    print(json.dumps(child(a.op, a.target, a.tokens, a.uri, a.path)))


if __name__ == "__main__":
    main()
