"""file://: safetensors files plus a shared SQLite index; crash, corruption and many processes."""

import errno
import hashlib
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import mlx.core as mx
import pytest
from helpers import bits, run_py
from safetensors import safe_open
from threads import run_threads

import mlxcache
from mlxcache import CacheBackend, Record
from mlxcache.backends.disk import DiskBackend
from mlxcache.backends.disk import backend as disk
from mlxcache.backends.disk import writes as disk_writes

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


def make_record(key: str, n: int | None = None) -> Record:
    """Content fixed by the key, so any process can check what it reads."""
    seed = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16)
    n = n if n is not None else 200 + seed % 800
    a = mx.random.normal((n,), key=mx.random.key(seed)).astype(mx.bfloat16)
    return Record({"a": a, "i": mx.arange(seed % 7 + 1, dtype=mx.int32)}, {"key": key, "n": n})


def same(a: Record, b: Record) -> bool:
    return (
        set(a.arrays) == set(b.arrays)
        and all(
            a.arrays[k].dtype == b.arrays[k].dtype
            and a.arrays[k].shape == b.arrays[k].shape
            and bits(a.arrays[k]) == bits(b.arrays[k])
            for k in a.arrays
        )
        and dict(a.meta) == dict(b.meta)
    )


def rec(n: int, fill: float = 1.0) -> Record:
    return Record({"x": mx.full((n,), fill, dtype=mx.float32)}, {"n": n})


def files(root: Path, sub: str) -> list[Path]:
    return sorted(p for p in (root / sub).rglob("*") if p.is_file())


def data_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in files(root, "data"))


def index_rows(root: Path) -> dict[str, tuple[str, int]]:
    with sqlite3.connect(root / "index.sqlite") as db:
        return {k: (f, s) for k, f, s in db.execute("SELECT key, file, size FROM entries")}


def assert_consistent(root: Path, max_bytes: int | None = None) -> None:
    """Index totals match the rows, rows match the files, no debris, every entry verifies."""
    rows = index_rows(root)
    with sqlite3.connect(root / "index.sqlite") as db:
        settings = dict(db.execute("SELECT key, value FROM settings"))
    assert settings["count"] == len(rows)
    assert settings["size"] == sum(s for _, s in rows.values())
    assert files(root, "tmp") == []
    on_disk = {
        p.relative_to(root / "data").as_posix(): p.stat().st_size for p in files(root, "data")
    }
    assert on_disk == {f: s for f, s in rows.values()}
    if max_bytes is not None:
        assert settings["size"] <= max_bytes and sum(on_disk.values()) <= max_bytes
    b = DiskBackend(root)
    for key in rows:
        got = b.get(key)
        assert got is not None, key
        if "key" in got.meta:  # written by make_record: check every bit
            assert same(got, make_record(key, got.meta["n"])), key
    assert b.stats()["errors"] == 0
    b.close()


def spawn(code: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{TESTS}"}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


# ---------------------------------------------------------------- basics


def test_round_trip_is_bit_exact_and_files_are_plain_safetensors(tmp_path):
    mx.random.seed(0)
    dtypes = [mx.bool_, mx.uint8, mx.int8, mx.int32, mx.int64, mx.float16, mx.bfloat16]
    dtypes += [mx.float32, mx.float64, mx.complex64]
    arrays = {f"t{i}": (mx.random.normal((3, 5)) * 50).astype(d) for i, d in enumerate(dtypes)}
    arrays["strided"] = mx.random.normal((2, 6, 4)).astype(mx.bfloat16)[:, 1:4, :]
    arrays["empty"] = mx.zeros((0, 3), dtype=mx.bfloat16)
    arrays["nan_payload"] = mx.array([0x7FC1, 0xFFFF], dtype=mx.uint16).view(mx.bfloat16)
    record = Record(arrays, {"tokens": [1, 2, 3], "raw": b"\x00\xff", "none": None})
    b = mlxcache.open_backend(f"file://{tmp_path}")
    assert isinstance(b, DiskBackend) and isinstance(b, CacheBackend)
    b.put("k", record)
    got = b.get("k")
    assert got is not None and same(got, record)
    (path,) = files(tmp_path, "data")
    digest = hashlib.sha256(b"k").hexdigest()
    assert path.parent.name == digest[:2] and path.name.startswith(f"{digest}-{os.getpid()}-")
    assert path.stat().st_size == b.stats()["bytes"]
    with safe_open(str(path), "numpy") as f:  # a plain safetensors file
        assert set(f.keys()) == set(arrays) and (f.get_tensor("t3") == arrays["t3"]).all()
    got.arrays["t0"][0, 0] = True  # what get returned is the caller's own
    assert same(b.get("k"), record)


def test_uri_forms(tmp_path, monkeypatch):
    b = mlxcache.open_backend(f"file://{tmp_path}/a/b?max_bytes=20GiB")
    assert b.root == tmp_path / "a" / "b" and (tmp_path / "a" / "b" / "index.sqlite").exists()
    assert b.stats()["max_bytes"] == 20 * 2**30 and b.stats()["path"] == str(tmp_path / "a/b")
    monkeypatch.setenv("HOME", str(tmp_path))
    home = mlxcache.open_backend("file://~/cache", max_bytes="1.5KB", timeout=2)
    assert home.root == tmp_path / "cache" and home.max_bytes == 1500 and home.timeout == 2
    assert mlxcache.open_backend(f"file://localhost{tmp_path}/c").root == tmp_path / "c"
    assert DiskBackend(tmp_path / "d").max_bytes is None  # unbounded by default
    for bad in ("file://somehost/x", "file://", f"file://{tmp_path}?max_bytes=lots"):
        with pytest.raises(ValueError):
            mlxcache.open_backend(bad)
    with pytest.raises(ValueError, match="max_bytes"):
        mlxcache.open_backend(f"file://{tmp_path}?maxbytes=1")


def test_refused_puts_leave_no_file(tmp_path):
    """Wrong arguments, an oversize record and a zero budget write nothing to the folder."""
    mlxcache.open_backend(f"file://{tmp_path}?max_bytes=0").put("a", rec(1))
    DiskBackend(tmp_path, max_bytes=2000).put("huge", rec(1000))
    b = DiskBackend(tmp_path)
    for key, value, exc in [
        (1, rec(1), TypeError),
        ("", rec(1), ValueError),
        ("\ud800", rec(1), ValueError),
        ("a", {"x": mx.zeros(1)}, TypeError),
    ]:
        with pytest.raises(exc):
            b.put(key, value)
    with pytest.raises(TypeError):
        b.get(b"a")
    with pytest.raises(TypeError):
        b.contains_many(["a", 2])
    assert files(tmp_path, "data") == [] and files(tmp_path, "tmp") == [] and len(b) == 0


def test_threads_share_one_backend(tmp_path):
    b = DiskBackend(tmp_path, max_bytes=40_000)
    bad: list[str] = []

    def work(t: int) -> None:
        for i in range(15):
            key = f"k{(t * 7 + i) % 12}"
            b.put(key, make_record(key))
            got = b.get(f"k{i % 12}")
            if got is not None and not same(got, make_record(f"k{i % 12}")):
                bad.append(key)

    assert run_threads(work, 4) == []  # an exception on a worker thread fails the test
    assert not bad and b.stats()["errors"] == 0
    b.close()
    assert_consistent(tmp_path, 40_000)


# ---------------------------------------------------------------- byte budget


def test_budget_counts_file_bytes_once_per_key_and_evicts_lru(tmp_path):
    b = DiskBackend(tmp_path)
    b.put("a", rec(100))
    size = b.stats()["bytes"]
    assert size == data_bytes(tmp_path) and size > 400  # the file: header + tensor bytes
    b.put("a", rec(100, 2.0))
    assert b.stats()["bytes"] == size and len(files(tmp_path, "data")) == 1
    b.put("a", rec(200))  # a re-put replaces the size
    assert b.stats()["bytes"] == data_bytes(tmp_path) == size + 400
    b.clear()

    b = DiskBackend(tmp_path, max_bytes=3 * size + 10)
    for key in "abc":
        b.put(key, rec(100))
    assert b.get("a") is not None  # a is now the most recent
    b.put("d", rec(100))  # 4 entries do not fit: b, the least recently used, goes
    assert sorted(b.keys()) == ["a", "c", "d"] and b.stats()["evictions"] == 1
    assert b.stats()["bytes"] == data_bytes(tmp_path) == 3 * size
    assert_consistent(tmp_path, 3 * size + 10)


def test_open_with_smaller_budget_evicts_down_to_it(tmp_path):
    b = DiskBackend(tmp_path)
    for key in "abc":
        b.put(key, rec(100))
        time.sleep(0.01)
    assert b.get("a") is not None  # LRU order now: b, c, a
    size = b.stats()["bytes"] // 3
    b.close()
    small = DiskBackend(tmp_path, max_bytes=2 * size)  # what `mlxcache gc --max-bytes` does
    assert sorted(small.keys()) == ["a", "c"] and small.stats()["evictions"] == 1
    assert data_bytes(tmp_path) == 2 * size
    assert DiskBackend(tmp_path).stats()["entries"] == 2  # opening without a budget keeps all


# ---------------------------------------------------------------- damaged entries


def _damage(path: Path, how: str) -> None:
    blob = path.read_bytes()
    if how == "flipped":
        path.write_bytes(blob[:-10] + bytes([blob[-10] ^ 0x01]) + blob[-9:])
    elif how == "truncated":
        path.write_bytes(blob[: len(blob) // 2])
    elif how == "foreign":
        mx.save_safetensors(str(path), {"a": mx.zeros((300,), dtype=mx.bfloat16)})
    elif how == "newer":
        from record_bytes import with_version

        path.write_bytes(with_version(blob, 9))
    elif how == "missing":
        path.unlink()


@pytest.mark.parametrize("how", ["flipped", "truncated", "foreign", "newer", "missing"])
def test_unreadable_file_is_a_logged_miss_and_quarantined(tmp_path, caplog, how):
    b = DiskBackend(tmp_path)
    b.put("ok", make_record("ok"))
    b.put("k", make_record("k"))
    path = tmp_path / "data" / index_rows(tmp_path)["k"][0]
    _damage(path, how)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mlxcache"):
        assert b.get("k") is None
    assert [r.name for r in caplog.records] == ["mlxcache"] and "'k'" in caplog.text
    stats = b.stats()
    assert (stats["errors"], stats["misses"], stats["entries"]) == (1, 1, 1)
    assert "k" not in b and not path.exists()
    quarantined = [p.name for p in files(tmp_path, "quarantine")]
    assert quarantined == ([] if how == "missing" else [path.name])
    assert same(b.get("ok"), make_record("ok"))
    assert b.get("k") is None and b.stats()["errors"] == 1  # gone now: a plain miss
    b.put("k", make_record("k"))
    assert same(b.get("k"), make_record("k"))


def test_full_disk_is_a_logged_no_op(tmp_path, monkeypatch, caplog):
    b = DiskBackend(tmp_path)
    b.put("a", make_record("a"))
    before = index_rows(tmp_path)
    real_write = disk_writes.write_file

    def full(path, head, views, *mode, **sync):  # the disk fills up halfway through the file
        with open(path, "xb") as f:
            f.write(head)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_writes, "write_file", full)
    b.put("b", make_record("b"))  # does not raise
    b.put("a", make_record("a", 50))  # a failed re-put keeps the old entry
    assert "b" not in b and index_rows(tmp_path) == before
    assert b.stats()["errors"] == 2 and "No space left" in caplog.text
    assert files(tmp_path, "tmp") == []
    monkeypatch.setattr(disk_writes, "write_file", real_write)
    assert same(b.get("a"), make_record("a"))
    assert_consistent(tmp_path)


def test_index_errors_are_misses_and_no_ops(tmp_path):
    b = mlxcache.open_backend(f"file://{tmp_path}?timeout=0.2")
    b.put("a", make_record("a"))
    other = sqlite3.connect(tmp_path / "index.sqlite", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process holds the write lock too long
    try:
        b.put("b", make_record("b"))
        assert b.stats()["errors"] == 1 and "b" not in b and not b.delete("a")
        assert b.stats()["errors"] == 2
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert "a" in b and index_rows(tmp_path).keys() == {"a"}
    assert_consistent(tmp_path)

    def broken(keys):
        raise sqlite3.OperationalError("disk I/O error")

    b._lookup = broken
    assert b.get("a") is None and b.contains_many(["a"]) == [False]
    assert b.stats()["errors"] == 4


def test_unusable_folder_is_a_clear_error_at_open(tmp_path, monkeypatch):
    """The default folder under an unusable HOME fails at open, naming the folder and the fix."""
    (tmp_path / "file").write_bytes(b"")
    monkeypatch.setenv("HOME", str(tmp_path / "file" / "home"))
    monkeypatch.delenv("MLXCACHE_URL", raising=False)
    with pytest.raises(OSError, match=r"\.cache/mlxcache.*MLXCACHE_URL"):
        mlxcache.open_backend()

    def refuse(*args, **kwargs):
        raise sqlite3.OperationalError("unable to open database file")

    monkeypatch.setattr(sqlite3, "connect", refuse)  # e.g. a read-only folder
    with pytest.raises(OSError, match=f"{tmp_path / 'ro'}.*unable to open database file"):
        DiskBackend(tmp_path / "ro")


def test_folder_removed_under_a_running_backend_is_misses_and_no_ops(tmp_path):
    import shutil

    b = DiskBackend(tmp_path / "c")
    b.put("a", rec(3))
    shutil.rmtree(tmp_path / "c")
    results = []

    def use() -> None:
        b.put("b", rec(3))
        results.append((b.get("a"), "a" in b, b.get_many(["a", "b"]), b.delete("b")))
        list(b.keys()), len(b), b.stats(), b.header("a"), b.clear()

    use()  # this thread's open connection
    t = threading.Thread(target=use)  # a new connection to a missing index
    t.start()
    t.join()
    assert results == [(None, False, [None, None], False)] * 2
    assert b.stats()["errors"] >= 4
    b.close()
    b.close()


def test_unreadable_index_is_set_aside(tmp_path, caplog):
    (tmp_path / "index.sqlite").write_bytes(b"this is not a database" * 100)
    b = DiskBackend(tmp_path)
    b.put("a", rec(3))
    assert "a" in b and "unreadable" in caplog.text
    assert [p.name for p in files(tmp_path, "quarantine")][0].startswith("index-")


def test_fork_child_uses_its_own_connection(tmp_path):
    b = DiskBackend(tmp_path)
    b.put("a", rec(3))
    b.put("b", rec(3))
    assert "a" in b  # the parent's connection is open
    pid = os.fork()
    if pid == 0:
        ok = "a" in b and b.delete("b") and len(b) == 1 and b._pid == os.getpid()
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert "b" not in b and len(b) == 1 and b.get("a") is not None


# ---------------------------------------------------------------- processes


def test_warm_start_in_new_processes_reads_no_tensor_data(tmp_path):
    keys = ["w/1", "w/2", "w/3"]
    write = run_py(
        """
        import sys, mlxcache
        from test_disk_backend import make_record
        b = mlxcache.open_backend("file://" + sys.argv[1])
        for k in sys.argv[2:]:
            b.put(k, make_record(k))
        """,
        str(tmp_path), *keys, check=False,
    )  # fmt: skip
    assert write.returncode == 0, write.stderr
    read = run_py(
        """
        import sys, mlxcache
        from mlxcache.records import reader as format_read
        from test_disk_backend import make_record, same
        real = format_read.read_file, format_read.read_header
        def boom(*a):
            raise AssertionError("tensor file read")
        format_read.read_file = format_read.read_header = boom
        b = mlxcache.open_backend("file://" + sys.argv[1])
        keys = sys.argv[2:]
        assert len(b) == 3 and sorted(b.keys("w/")) == keys, list(b.keys())
        assert b.contains_many(keys + ["x"]) == [True] * 3 + [False]
        assert b.stats()["bytes"] > 0
        format_read.read_file, format_read.read_header = real
        assert all(same(b.get(k), make_record(k)) for k in keys)
        print("ok", b.stats()["hits"])
        """,
        str(tmp_path), *keys,
    )  # fmt: skip
    assert read.split() == ["ok", "3"]


WORKER = """
    import random, sys, mlxcache
    from test_disk_backend import make_record, same
    b = mlxcache.open_backend(f"file://{sys.argv[1]}?max_bytes={sys.argv[2]}")
    rng = random.Random(int(sys.argv[3]))
    hits = 0
    print("ready", flush=True)
    sys.stdin.readline()  # all workers start together
    for i in range(150):
        key = f"k{rng.randrange(24)}"
        if rng.random() < 0.5:
            b.put(key, make_record(key))
        else:
            got = b.get(key)
            if got is not None:
                assert same(got, make_record(key)), key
                hits += 1
        if i % 20 == 0:
            b.delete(f"k{rng.randrange(24)}")
    assert b.stats()["errors"] == 0, b.stats()
    print(hits)
"""


def test_many_processes_share_one_folder_and_budget(tmp_path):
    max_bytes = 12_000  # about six records: constant eviction by everyone
    procs = [spawn(WORKER, str(tmp_path), str(max_bytes), str(seed)) for seed in range(4)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    outs = [p.communicate(timeout=60) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    assert sum(int(out) for out, _ in outs) > 0  # processes read each other's entries
    assert_consistent(tmp_path, max_bytes)


KILLED_WRITER = """
    import sys, time, mlx.core as mx, mlxcache
    from mlxcache import Record
    from mlxcache.backends.disk import backend as disk
    from mlxcache.backends.disk import writes as disk_writes

    def hang(msg):
        print(msg, flush=True)
        time.sleep(60)

    def arm(stage):
        if stage == "write":  # killed halfway through writing a temp file
            def _write_file(path, head, views, *mode, **sync):
                with open(path, "xb") as f:
                    f.write(head)
                    f.write(views[0][: len(views[0]) // 2])
                    f.flush()
                    hang("ready")
            disk_writes.write_file = _write_file
        elif stage == "rename":  # killed after the rename into data/, before the index commit
            real_fsync = disk_writes.fsync_dir
            def _fsync_dir(path):
                real_fsync(path)
                if path.parent.name == "data":
                    hang("ready")
            disk_writes.fsync_dir = _fsync_dir
        elif stage == "unlink":  # killed after the commit, before the replaced file is removed
            disk.DiskBackend._remove_files = lambda self, *a, **k: hang("ready")

    b = mlxcache.open_backend(f"file://{sys.argv[1]}?max_bytes=40MB")
    big = mx.random.normal((1_000_000,)).astype(mx.bfloat16)  # 2 MB
    b.put("k0", Record({"a": big}, {"n": 0}))
    b.put("k0", Record({"a": big + 1}, {"n": 0}))
    arm(sys.argv[2])
    print("started", flush=True)
    for i in range(10_000):
        b.put(f"k{i % 30}", Record({"a": big, "i": mx.array([i])}, {"n": i}))
"""


@pytest.mark.parametrize("stage", ["loop", "write", "rename", "unlink"])
def test_sigkilled_writer_leaves_a_consistent_folder(tmp_path, stage):
    p = spawn(KILLED_WRITER, str(tmp_path), stage)
    try:
        first = p.stdout.readline().strip()
        assert first == "started", p.stderr.read() if first == "" else first
        if stage == "loop":
            time.sleep(0.3)  # somewhere in the middle of a put
        else:
            assert p.stdout.readline().strip() == "ready"
        p.send_signal(signal.SIGKILL)
    finally:
        p.kill()
        p.wait()
    if stage == "write":
        assert len(files(tmp_path, "tmp")) == 1  # the half-written temp file
    if stage in ("rename", "unlink"):
        assert len(files(tmp_path, "data")) == len(index_rows(tmp_path)) + 1
    b = DiskBackend(tmp_path)  # the next open removes the dead writer's debris
    assert len(b) >= 1
    for key in b.keys():
        got = b.get(key)
        assert got is not None and got.arrays["a"].shape == (1_000_000,), key
    assert b.stats()["errors"] == 0 and files(tmp_path, "tmp") == []
    rows = index_rows(tmp_path)
    on_disk = {p.relative_to(tmp_path / "data").as_posix() for p in files(tmp_path, "data")}
    assert on_disk == {f for f, _ in rows.values()}
    assert b.stats()["bytes"] == data_bytes(tmp_path) <= 40_000_000


def test_open_keeps_live_writers_files_and_removes_dead_ones(tmp_path):
    b = DiskBackend(tmp_path)
    live = spawn("import time; time.sleep(60)")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        tmp, data = tmp_path / "tmp", tmp_path / "data" / "ab"
        data.mkdir()
        keep = [tmp / f"{live.pid}-aa.tmp", data / f"{'ab' * 32}-{live.pid}-aa.safetensors"]
        drop = [tmp / f"{dead.pid}-bb.tmp", data / f"{'ab' * 32}-{dead.pid}-bb.safetensors"]
        old = tmp / f"{live.pid}-cc.tmp"  # a live pid, but untouched for two hours
        for path in [*keep, *drop, old]:
            path.write_bytes(b"partial")
        os.utime(old, (time.time() - 7200, time.time() - 7200))
        b.put("x", rec(3))  # an indexed file of a dead writer stays too
        DiskBackend(tmp_path)
        assert all(p.exists() for p in keep) and not any(p.exists() for p in [*drop, old])
        assert b.get("x") is not None
    finally:
        live.kill()
        live.wait()


def test_cleanup_at_open_touches_only_files_it_wrote(tmp_path):
    """A folder that already holds other files (file://~, a project dir) loses none of them."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    foreign = [
        tmp_path / "tmp" / "notes.txt",
        tmp_path / "tmp" / f"{dead.pid}-report.tmp",
        tmp_path / "data" / "photos" / "cat.jpg",
        tmp_path / "data" / "ab" / "readme.safetensors",
        tmp_path / "data" / "cd" / f"{'ab' * 32}-{dead.pid}-aa.safetensors",  # wrong folder
        tmp_path / "quarantine" / "evidence.txt",
    ]
    ours = tmp_path / "data" / "ab" / f"{'ab' * 32}-{dead.pid}-aa.safetensors"
    old = time.time() - 30 * 86400
    for path in [*foreign, ours]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"precious")
        os.utime(path, (old, old))
    DiskBackend(tmp_path)
    assert [p for p in foreign if not p.exists()] == []
    assert not ours.exists()


@pytest.mark.parametrize("race", ["re-put", "delete"])
def test_entry_replaced_or_deleted_while_being_read_is_no_error(tmp_path, monkeypatch, race):
    reader, writer = DiskBackend(tmp_path), DiskBackend(tmp_path)
    reader.put("k", make_record("k", 100))
    real_read = disk.format_read.read_file
    calls = []

    def read_file(path, **kw):
        if not calls:  # another process changes the entry between lookup and read
            if race == "re-put":
                writer.put("k", make_record("k", 300))
            else:
                writer.delete("k")
        calls.append(path)
        return real_read(path, **kw)

    monkeypatch.setattr(disk.format_read, "read_file", read_file)
    got = reader.get("k")
    if race == "re-put":
        assert len(calls) == 2 and same(got, make_record("k", 300))
    else:
        assert got is None and len(calls) == 1
    assert reader.stats()["errors"] == 0 and files(tmp_path, "quarantine") == []


def test_header_reads_no_tensor_data_and_drops_foreign_files(tmp_path, monkeypatch):
    b = DiskBackend(tmp_path)
    b.put("k", make_record("k", 100))
    b.put("bad", make_record("bad"))
    monkeypatch.setattr(disk.format_read, "read_file", None)  # header() must not load tensors
    header = b.header("k")
    assert header.meta == {"key": "k", "n": 100} and [t.name for t in header.tensors] == ["a", "i"]
    assert b.header("nope") is None
    _damage(tmp_path / "data" / index_rows(tmp_path)["bad"][0], "foreign")
    assert b.header("bad") is None and "bad" not in b and b.stats()["errors"] == 1
