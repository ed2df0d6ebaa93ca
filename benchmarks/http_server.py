"""A server subprocess on a free loopback port, started and waited for: the benchmarks' servers.

Every server benchmark (lm_server, vlm_server, vllm_server, agents_engines) starts an engine's
server the same way: a free port, its output to a log file, ``GET /health`` until it answers;
a server that exits or takes longer than ``timeout`` seconds is killed and named in the error.
"""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO


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


__all__ = ["free_port", "launch"]
