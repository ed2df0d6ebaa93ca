"""Test helpers shared by every test module: bit comparisons, sample records, subprocesses."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import IO

import mlx.core as mx

from mlxcache import Record
from mlxcache.backends.memory import MemoryBackend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")

# every dtype a record can hold
DTYPES = [
    mx.bool_, mx.uint8, mx.uint16, mx.uint32, mx.uint64, mx.int8, mx.int16, mx.int32, mx.int64,
    mx.float16, mx.bfloat16, mx.float32, mx.float64, mx.complex64,
]  # fmt: skip


def bits(a: mx.array) -> bytes:
    """The raw bytes of an array in row-major order (compare these, not values: NaN, bf16)."""
    return bytes(memoryview(mx.contiguous(a)))


def assert_same(a: Record, b: Record) -> None:
    """Same tensor names, dtypes, shapes and bits, and equal metadata."""
    assert set(a.arrays) == set(b.arrays)
    for name, x in a.arrays.items():
        y = b.arrays[name]
        assert (x.dtype, x.shape) == (y.dtype, y.shape), name
        assert bits(x) == bits(y), name
    assert dict(a.meta) == dict(b.meta)


def sample_record(seed: int = 1) -> Record:
    """One tensor of every dtype, a strided bf16 view, an empty and a 0-d tensor, a NaN payload."""
    mx.random.seed(seed)
    arrays = {f"t{i}": (mx.random.normal((3, 5)) * 100).astype(d) for i, d in enumerate(DTYPES)}
    arrays["strided"] = mx.random.normal((2, 6, 4)).astype(mx.bfloat16)[:, 1:4, :]
    arrays["empty"] = mx.zeros((0, 7), dtype=mx.bfloat16)
    arrays["scalar"] = mx.array(7, dtype=mx.int32)
    # a NaN with a payload: a float32 round trip would not keep these bits
    arrays["nan_payload"] = mx.array([0x7FC1, 0xFFFF, 0x0001], dtype=mx.uint16).view(mx.bfloat16)
    return Record(arrays, {"tokens": [1, 2, 3], "name": "x", "raw": b"\x00\xff", "n": None})


def blob_record(nbytes: int, seed: int = 0) -> Record:
    """A record whose tensor bytes are exactly ``nbytes`` (stored size: plus a small header)."""
    data = mx.random.randint(0, 256, (nbytes,), dtype=mx.uint8, key=mx.random.key(seed))
    mx.eval(data)  # MLX evaluates a graph only on the thread that built it
    return Record({"x": data}, {"seed": seed})


def run_py(code: str, *args: str, timeout: float = 60, check: bool = True, **kw):
    """Run ``code`` in a fresh interpreter with the checkout and tests/ importable.

    With ``check`` (default) a failing child fails the test and its stdout is returned;
    otherwise the CompletedProcess is.
    """
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{TESTS}", **kw.pop("env", {})}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env=env, capture_output=True, text=True, timeout=timeout, check=False, **kw,
    )  # fmt: skip
    if not check:
        return proc
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def run_file(path: str, *args: str, timeout: float = 300) -> dict:
    """Run the file ``path`` with ``args`` in a fresh interpreter with the checkout importable;
    a failing run fails the test, else the JSON of its last output line."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
    )
    proc = subprocess.run(
        [sys.executable, path, *args], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


class CountingBackend(MemoryBackend):
    """A real memory backend that counts calls: each batch call is one round trip."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.calls: collections.Counter[str] = collections.Counter()
        self.reads = 0  # keys read, by get or get_many

    def get(self, key):  # a single get outside get_many would be another round trip
        self.calls["get"] += 1
        self.reads += 1
        return MemoryBackend.get_many(self, [key])[0]

    def get_many(self, keys):
        keys = list(keys)
        self.calls["get_many"] += 1
        self.reads += len(keys)
        return super().get_many(keys)

    def contains_many(self, keys):
        self.calls["contains_many"] += 1
        return super().contains_many(keys)


class BrokenBackend(MemoryBackend):
    """A real memory backend whose ``fail`` call ("lookup": contains_many, "store": put) raises,
    like a third-party backend with a bug."""

    def __init__(self, fail: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fail = fail

    def contains_many(self, keys):
        if self.fail == "lookup":
            raise RuntimeError("backend bug: contains_many")
        return super().contains_many(keys)

    def put(self, key, record):
        if self.fail == "store":
            raise RuntimeError("backend bug: put")
        return super().put(key, record)


def full_kv(n: int, fill: float = 1.0) -> list:
    """Two evaluated mlx-lm KVCache layers of ``n`` tokens: keys ``fill + layer``, values -keys."""
    from mlx_lm.models.cache import KVCache

    out = []
    for layer in range(2):
        c = KVCache()
        x = mx.full((1, 2, n, 4), fill + layer)
        c.update_and_fetch(x, -x)
        out.append(c)
    mx.eval([c.keys for c in out])
    return out


def read_stream(response) -> tuple[str, dict | None]:
    """The text and the last usage of a chat completion streamed as server-sent events."""
    parts, usage = [], None
    for raw in response:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[len("data: ") :])
            for choice in chunk.get("choices") or ():
                parts.append((choice.get("delta") or {}).get("content") or "")
            usage = chunk.get("usage") or usage
    return "".join(parts), usage


class LoggedServer:
    """Base of the tests' server subprocesses at ``url``: ``proc``, its output to the open file
    ``_log`` at ``log_path``; ``post()`` sends JSON, ``log()`` reads the output, ``kill()`` ends
    it."""

    url: str
    proc: subprocess.Popen
    log_path: str | os.PathLike[str]
    _log: IO[bytes]

    def post(self, path: str, body: dict, headers: dict | None = None) -> dict:
        """The JSON answer (a 200) to ``body`` POSTed as JSON to ``path``."""
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        with urllib.request.urlopen(req, timeout=180) as r:
            assert r.status == 200
            return json.load(r)

    def log(self) -> str:
        """The server's output so far ("" before it wrote any); also after ``kill``."""
        if not self._log.closed:
            self._log.flush()
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL: nothing flushes, nothing shuts down cleanly, nothing is saved at shutdown."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._log.close()


def wait_until_healthy(server, what: str, timeout: float, log_tail: int | None = None) -> None:
    """Poll ``server.url`` + ``/health`` until it answers 200. If ``server.proc`` exits or
    ``timeout`` seconds pass, kill the server and raise with its log (the last ``log_tail``
    characters). ``server`` has ``url``, ``proc``, ``kill()`` and ``log()``."""
    import time
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if server.proc.poll() is not None or time.monotonic() > deadline:
            server.kill()
            log = server.log()
            raise RuntimeError(f"{what} did not start:\n{log[-log_tail:] if log_tail else log}")
        time.sleep(0.2)


@contextlib.contextmanager
def started_together(make: list) -> Iterator[list]:
    """Servers started at once (one thread each, ``make``: their constructors), killed at the
    end; a server that failed to start raises after the others are killed."""
    with ThreadPoolExecutor(len(make)) as pool:
        starting = [pool.submit(f) for f in make]
    servers = [f.result() for f in starting if f.exception() is None]
    try:
        failed = [f.exception() for f in starting if f.exception() is not None]
        if failed:
            raise failed[0]
        yield servers
    finally:
        for server in servers:
            server.kill()
