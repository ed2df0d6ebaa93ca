"""Which sync call makes a file durable: F_FULLFSYNC on macOS, fsync/syncfs on Linux (issue 21).

macOS's ``fsync`` leaves the data in the drive's write cache; ``?sync=always`` and ``batch``
must use ``fcntl(F_FULLFSYNC)`` there (and SQLite's fullfsync pragmas). CI runs Linux, so the
choice is a function of the platform name: these tests run the real write path with the
macOS choice (``F_FULLFSYNC`` is refused by Linux, EINVAL, and falls back to fsync, as it does
on a macOS filesystem that lacks it) and with Linux's, and record the calls made.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
from collections import Counter

import mlx.core as mx
import pytest

import mlxcache
from mlxcache import Record
from mlxcache.backends.disk import durable


def rec(i: int) -> Record:
    return Record({"a": mx.full((64,), float(i))}, {"i": i})


def test_the_platform_choice():
    mac = durable.for_platform("darwin")
    assert (mac.file, mac.batch) == ("F_FULLFSYNC", "fsync+F_FULLFSYNC")
    assert "PRAGMA fullfsync=ON" in mac.pragmas and "PRAGMA checkpoint_fullfsync=ON" in mac.pragmas
    linux = durable.for_platform("linux")
    assert (linux.file, linux.batch, linux.pragmas) == ("fsync", "syncfs", ())
    other = durable.for_platform("freebsd14")
    assert (other.file, other.batch) == ("fsync", "fsync")
    assert durable.F_FULLFSYNC == 51  # <sys/fcntl.h> on macOS


@pytest.fixture
def calls(monkeypatch):
    """Every fsync, F_FULLFSYNC and syncfs the write path makes (each still really done)."""
    seen: Counter[str] = Counter()
    real_fsync, real_fcntl, real_syncfs = os.fsync, fcntl.fcntl, durable._SYNCFS

    def fsync(fd):
        seen["fsync"] += 1
        return real_fsync(fd)

    def fcntl_(fd, cmd, *args):
        if cmd == durable.F_FULLFSYNC:
            seen["F_FULLFSYNC"] += 1
        return real_fcntl(fd, cmd, *args)

    def syncfs(fd):
        seen["syncfs"] += 1
        return real_syncfs(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(durable.fcntl, "fcntl", fcntl_)
    monkeypatch.setattr(durable, "_SYNCFS", syncfs)
    return seen


@pytest.mark.parametrize("platform", ["darwin", "linux"])
@pytest.mark.parametrize("mode", ["always", "batch"])
def test_sync_modes_use_the_platform_call(tmp_path, monkeypatch, calls, platform, mode):
    monkeypatch.setattr(durable, "CURRENT", durable.for_platform(platform))
    with mlxcache.open_backend(f"file://{tmp_path}/c?sync={mode}") as b:
        b.put("warm", rec(0))  # the index and folders exist: count the writes alone
        calls.clear()
        b.put_many([(f"k{i}", rec(i)) for i in range(3)])
        assert [b.get(f"k{i}").meta["i"] for i in range(3)] == [0, 1, 2]
    if platform == "darwin":
        assert calls["syncfs"] == 0
        # always: each file and its folder; batch: one full flush after the plain fsyncs
        assert calls["F_FULLFSYNC"] >= (6 if mode == "always" else 1)
        if mode == "batch":
            assert calls["F_FULLFSYNC"] == 1 and calls["fsync"] >= 4
    else:
        assert calls["F_FULLFSYNC"] == 0
        if mode == "always":
            assert calls["fsync"] >= 6 and calls["syncfs"] == 0
        else:
            assert calls["syncfs"] == 1


def test_the_index_gets_the_fullfsync_pragmas_on_macos(tmp_path, monkeypatch):
    monkeypatch.setattr(durable, "CURRENT", durable.for_platform("darwin"))
    with mlxcache.open_backend(f"file://{tmp_path}/c") as b:
        b.put("k", rec(1))
        conn = b._db()
        assert conn.execute("PRAGMA fullfsync").fetchone()[0] == 1
        assert conn.execute("PRAGMA checkpoint_fullfsync").fetchone()[0] == 1
    with sqlite3.connect(tmp_path / "c" / "index.sqlite") as db:
        assert db.execute("SELECT count(*) FROM entries").fetchone()[0] == 1
