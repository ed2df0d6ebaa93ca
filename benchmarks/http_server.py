"""A server subprocess on a free loopback port, started and waited for: the benchmarks' servers.

Every server benchmark (lm_server, vlm_server, vllm_server, agents_engines) starts an engine's
server the same way: a free port, its output to a log file, ``GET /health`` until it answers;
a server that exits or takes longer than ``timeout`` seconds is killed and named in the error;
``timed_chat`` times one chat completion on it.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(
    cmd: list[str],
    env: dict[str, str],
    log: Path,
    *,
    cwd: Path | None = None,
    timeout: float = 300,
) -> tuple[subprocess.Popen, int, IO[bytes]]:
    """Start ``cmd`` with ``--host 127.0.0.1 --port P`` appended, its output appended to
    ``log``, and wait until ``/health`` answers: (the process, P, the open log file)."""
    port = free_port()
    out = open(log, "ab")  # noqa: SIM115 - the caller closes it when it stops the server
    proc = subprocess.Popen([*cmd, "--host", "127.0.0.1", "--port", str(port)], env=env,
                            cwd=cwd, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc, port, out
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait(30)
                out.close()
                raise RuntimeError(f"{' '.join(cmd[:4])} did not start; see {log}") from None
            time.sleep(0.3)


def timed_chat(port: int, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(seconds, usage) of one non-streaming chat completion on the server at ``port``."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.load(r)
    return time.perf_counter() - t0, out["usage"]


__all__ = ["free_port", "launch", "timed_chat"]
