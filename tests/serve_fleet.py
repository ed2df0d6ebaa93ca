"""Workers of ``mlxcache serve`` under load and faults, for tests/test_load_faults.py and the soak.

An ``Engine`` (tests/fleet_engines.py) says how to build a tiny local model, what a request to
it looks like and what it answers uncached; a ``Worker`` is one ``mlxcache serve`` subprocess on
a fixed loopback port (SIGKILLed and started again on the same port); a ``Load`` runs client
threads that send a few distinct prompts to every worker at once and records each answer (or
failure) with the worker's generation, so a failure can be told apart: in flight to a worker
that was killed, or not.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleet_engines import ENGINES, REQUEST_TIMEOUT, Engine, chat, text_of
from helpers import wait_until_healthy

__all__ = ["ENGINES", "Answer", "Engine", "Load", "Worker", "free_port", "start_workers"]

START_TIMEOUT = 180.0  # seconds a worker may take to answer /health (2 busy cores)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Answer:
    """One request of a ``Load``: what came back, or the error, and when."""

    worker: int
    prompt: int
    generation: int  # the worker's generation when the request was sent
    start: float
    generation_after: int = -1  # ... and when it came back
    end: float = 0.0
    text: str | None = None
    prompt_tokens: int = 0
    cached: int = 0
    error: str | None = None


def _limit_file_size(nbytes: int) -> Callable[[], None]:
    def apply() -> None:  # runs in the child between fork and exec
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, resource.RLIM_INFINITY))

    return apply


class Worker:
    """``mlxcache serve`` on a fixed port; its output is appended to ``log_path``."""

    def __init__(self, engine: Engine, model: str, cache: str, log_path: Path, *extra: str):
        self.engine, self.model, self.cache, self.extra = engine, model, cache, extra
        self.log_path = Path(log_path)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.generation = 0  # +1 at every kill: a request sent before it may fail
        self.up = threading.Event()
        self.file_size_limit: int | None = None  # RLIMIT_FSIZE of the next start

    def start(self, wait: bool = True) -> Worker:
        args = [self.engine.python(), "-m", "mlxcache", "serve", "--model", self.model]
        args += [*self.engine.flags, "--cache", self.cache]
        args += ["--host", "127.0.0.1", "--port", str(self.port), *self.extra]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        env.pop("APC_ENABLED", None)
        if self.engine.own_home:  # e.g. vllm-mlx's own disk cache lives under ~
            home = self.log_path.with_suffix(".home")
            home.mkdir(parents=True, exist_ok=True)
            env["HOME"] = str(home)
        # a pipe, not the file: a file-size limit on the worker must not stop its log
        limit = self.file_size_limit
        self.proc = subprocess.Popen(
            args,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            preexec_fn=None if limit is None else _limit_file_size(limit),
        )
        threading.Thread(target=self._drain, args=(self.proc,), daemon=True).start()
        if wait:
            self.wait_ready()
        return self

    def _drain(self, proc: subprocess.Popen) -> None:
        with open(self.log_path, "ab") as log:
            for line in proc.stdout:
                log.write(line)
                log.flush()

    def wait_ready(self) -> None:
        wait_until_healthy(self, "mlxcache serve", START_TIMEOUT, log_tail=4000)
        self.up.set()

    def kill(self) -> None:
        """SIGKILL: nothing flushes, nothing shuts down cleanly."""
        self.up.clear()
        self.generation += 1
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(30)

    def restart(self) -> None:
        self.kill()
        self.start()

    def limit_file_size(self, nbytes: int | None) -> None:
        """RLIMIT_FSIZE of the running worker (Linux ``prlimit``) and of its next starts: no
        file it writes may grow past ``nbytes`` (None lifts the limit), as on a full disk."""
        self.file_size_limit = nbytes
        soft = resource.RLIM_INFINITY if nbytes is None else nbytes
        if self.proc is None or self.proc.poll() is not None:
            return
        if hasattr(resource, "prlimit"):
            resource.prlimit(self.proc.pid, resource.RLIMIT_FSIZE, (soft, resource.RLIM_INFINITY))
        else:  # no prlimit (macOS): the limit comes with a restart
            self.restart()

    def chat(self, messages: Sequence[dict[str, Any]], max_tokens: int) -> tuple[str, int, int]:
        """(text, prompt_tokens, cached_tokens) of one greedy, non-streaming chat completion."""
        out = chat(self.url, list(messages), max_tokens, self.engine.body(self.model))
        usage = out["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return text_of(out), usage["prompt_tokens"], cached

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as {sample name: value summed over its labels}."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
        return out

    def rss_bytes(self) -> int:
        return process_rss(self.proc.pid)

    def open_fds(self) -> int:
        """Open file descriptors of the worker (``/proc`` on Linux, ``lsof`` elsewhere)."""
        try:
            return len(os.listdir(f"/proc/{self.proc.pid}/fd"))
        except OSError:
            out = subprocess.run(
                ["lsof", "-p", str(self.proc.pid)], capture_output=True, text=True
            ).stdout
            return max(0, len(out.splitlines()) - 1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def process_rss(pid: int) -> int:
    """Resident set size of a process in bytes (``/proc`` on Linux, ``ps`` elsewhere)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True)
    return int(out.stdout.strip()) * 1024


def start_workers(engine: Engine, model: str, cache: str, folder: Path, n: int = 2,
                  flags: Sequence[str] = ()) -> list[Worker]:  # fmt: skip
    """``n`` workers on one cache, started side by side (each loads the model)."""
    workers = [Worker(engine, model, cache, folder / f"worker{i}.log", *flags) for i in range(n)]
    for w in workers:
        w.start(wait=False)
    for w in workers:
        w.wait_ready()
    return workers


class Load:
    """Client threads sending ``prompts`` to every worker at once, until stopped.

    Thread ``t``'s ``k``-th request goes to worker ``(t + k) % len(workers)`` with prompt
    ``prompts[(t + 2k) % len(prompts)]``; a worker that is down is skipped, not waited for.
    ``prompts`` may be replaced while the load runs (new prompts: nothing cached yet).
    """

    def __init__(self, workers: list[Worker], prompts: Sequence[int], threads: int = 4,
                 max_tokens: int = 4) -> None:  # fmt: skip
        self.workers, self.max_tokens = workers, max_tokens
        self.prompts = list(prompts)
        self.answers: list[Answer] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._client, args=(t,), daemon=True) for t in range(threads)
        ]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(REQUEST_TIMEOUT + 10)

    def count(self) -> int:
        with self._lock:
            return len(self.answers)

    def wait_for(self, more: int, seconds: float = 0.0, timeout: float = 120.0) -> int:
        """Block until ``more`` requests have been answered (or failed) from now, and at least
        ``seconds`` have passed; returns the count of answers then."""
        target, now = self.count() + more, time.monotonic()
        until, deadline = now + seconds, now + timeout
        while self.count() < target or time.monotonic() < until:
            if time.monotonic() > deadline:
                raise TimeoutError(f"load made {self.count()} of {target} requests in time")
            time.sleep(0.05)
        return self.count()

    def _client(self, t: int) -> None:
        k = 0
        while not self._stop.is_set():
            i = (t + k) % len(self.workers)
            prompts = self.prompts
            w, prompt = self.workers[i], prompts[(t + 2 * k) % len(prompts)]
            k += 1
            if not w.up.is_set():
                time.sleep(0.01)
                continue
            a = Answer(i, prompt, w.generation, time.monotonic())
            try:
                a.text, a.prompt_tokens, a.cached = w.chat(
                    w.engine.messages(prompt), self.max_tokens
                )
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
                a.error = f"{type(e).__name__}: {e}"
            a.end, a.generation_after = time.monotonic(), w.generation
            with self._lock:
                self.answers.append(a)

    def failures(self) -> list[Answer]:
        """Failed requests that were not in flight to a worker killed while they ran."""
        return [
            a for a in self.answers if a.error is not None and a.generation_after == a.generation
        ]
