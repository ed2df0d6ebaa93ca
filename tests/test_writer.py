"""BackgroundWriter: ordered jobs on one thread, a bounded queue, drops counted, flush at exit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import mlx.core as mx
import pytest

from mlxcache import Record
from mlxcache.backends.memory import MemoryBackend
from mlxcache.backends.writer import BackgroundWriter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def blocked_writer(**kw) -> tuple[BackgroundWriter, threading.Event, threading.Event]:
    """A writer whose first job waits for ``release``; ``started`` is set when it runs."""
    w = BackgroundWriter(**kw)
    started, release = threading.Event(), threading.Event()

    def block() -> None:
        started.set()
        release.wait(30)

    assert w.submit(block)
    assert started.wait(10)
    return w, started, release


def test_jobs_run_in_order_and_flush_waits():
    w = BackgroundWriter()
    seen: list[int] = []
    for i in range(200):
        assert w.submit(lambda i=i: seen.append(i))
    assert w.flush(30)
    assert seen == list(range(200))
    s = w.stats()
    assert (s["queued"], s["written"], s["dropped"], s["pending"]) == (200, 200, 0, 0)
    w.close()


def test_full_queue_drops_at_once_and_counts():
    w, _, release = blocked_writer(queue=3, full="drop")
    ran: list[int] = []
    # the blocked job holds one place; two more fit, the rest are dropped
    results = [w.submit(lambda i=i: ran.append(i)) for i in range(5)]
    assert results == [True, True, False, False, False]
    assert w.stats()["dropped"] == 3
    release.set()
    assert w.flush(30)
    assert ran == [0, 1]
    w.close()


def test_full_queue_waits_bounded_then_drops():
    w, _, release = blocked_writer(queue=1, full="wait", max_wait=0.01)
    assert w.submit(lambda: None) is False  # nothing frees room within max_wait
    assert w.stats()["dropped"] == 1
    assert w.stats()["waited_s"] > 0
    release.set()
    w.close()


def test_full_queue_wait_takes_the_job_when_room_frees():
    w, _, release = blocked_writer(queue=1, full="wait", max_wait=30)
    threading.Timer(0.05, release.set).start()
    ran = []
    assert w.submit(lambda: ran.append(1)) is True  # waited for the blocker to finish
    assert w.flush(30) and ran == [1]
    assert w.stats()["dropped"] == 0
    w.close()


def test_byte_bound_and_a_single_large_job_still_goes():
    w, _, release = blocked_writer(queue_bytes=100, full="drop")
    assert w.submit(lambda: None, nbytes=60)
    assert not w.submit(lambda: None, nbytes=60)  # 60 + 60 > 100
    release.set()
    assert w.flush(30)
    assert w.submit(lambda: None, nbytes=10_000)  # alone in the queue: taken
    assert w.flush(30)
    assert w.stats()["dropped"] == 1
    w.close()


def test_a_failing_job_is_counted_and_the_next_ones_run(caplog):
    w = BackgroundWriter()
    ran = []
    w.submit(lambda: 1 / 0)
    w.submit(lambda: ran.append(1))
    assert w.flush(30)
    assert ran == [1] and w.stats()["failed"] == 1 and w.stats()["written"] == 1
    assert "ZeroDivisionError" in caplog.text
    w.close()


def test_close_flushes_and_later_submits_are_dropped():
    w = BackgroundWriter()
    ran = []
    w.submit(lambda: ran.append(1))
    w.close()
    assert ran == [1]
    assert w.submit(lambda: ran.append(2)) is False
    assert ran == [1] and w.stats()["dropped"] == 1


def test_submit_put_evaluates_lazy_arrays_on_the_callers_thread():
    backend = MemoryBackend()
    lazy = mx.arange(1000, dtype=mx.float32) * 3  # not evaluated: another thread could not
    w = BackgroundWriter()
    assert w.submit_put(backend, "k", Record({"x": lazy}))
    assert w.flush(30)
    assert w.stats()["failed"] == 0
    got = backend.get("k")
    assert got is not None and got.arrays["x"].tolist() == (mx.arange(1000) * 3).tolist()
    w.close()


def test_invalid_options_raise():
    for kw in ({"queue": 0}, {"queue_bytes": 0}, {"full": "block"}, {"max_wait": -1}):
        with pytest.raises(ValueError):
            BackgroundWriter(**kw)


def test_queued_writes_are_written_at_interpreter_exit(tmp_path):
    out = tmp_path / "out.txt"
    code = textwrap.dedent(
        f"""
        import time
        from mlxcache.backends.writer import BackgroundWriter
        w = BackgroundWriter()
        def job(i):
            time.sleep(0.01)
            with open({str(out)!r}, "a") as f:
                f.write(f"{{i}}\\n")
        for i in range(20):
            w.submit(lambda i=i: job(i))
        # no flush, no close: the interpreter exits with writes queued
        """
    )
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert out.read_text().split() == [str(i) for i in range(20)]
