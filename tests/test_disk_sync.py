"""file:// ``?sync=always|batch|never``: when files are fsynced, and what a lost write reads as.

A power loss can leave an index row naming a file whose bytes never reached the disk (``never``)
or whose write was torn; these tests make that state by hand (truncate, zero or remove the file
behind a published row), reopen the cache as after a reboot, and check it reads as a miss and a
log line, never as wrong bits, in every mode.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
from pathlib import Path

import mlx.core as mx
import pytest
from helpers import bits

import mlxcache
from mlxcache import Record
from mlxcache.backends.disk import DiskBackend, durable
from mlxcache.backends.disk import writes as disk_writes

MODES = ["always", "batch", "never"]


def rec(i: int, n: int = 300) -> Record:
    a = mx.random.normal((n,), key=mx.random.key(i)).astype(mx.bfloat16)
    return Record({"a": a}, {"i": i})


def rows(root: Path) -> dict[str, str]:
    with sqlite3.connect(root / "index.sqlite") as db:
        return dict(db.execute("SELECT key, file FROM entries"))


def damage(path: Path, how: str) -> None:
    """What a power loss can leave of a file that was not fsynced."""
    size = path.stat().st_size
    if how == "empty":  # the name reached the disk, no data block did
        path.write_bytes(b"")
    elif how == "torn":  # only the first part reached the disk
        path.write_bytes(path.read_bytes()[: size // 3])
    elif how == "zeroed":  # the size did, the data blocks read back as zeros
        path.write_bytes(bytes(size))
    elif how == "zeroed-tail":  # the header did, the tensor data did not
        blob = path.read_bytes()
        path.write_bytes(blob[: size - 200] + bytes(200))
    elif how == "missing":  # the rename never reached the disk
        path.unlink()


@pytest.mark.parametrize("how", ["empty", "torn", "zeroed", "zeroed-tail", "missing"])
@pytest.mark.parametrize("mode", MODES)
def test_a_lost_file_behind_a_published_row_is_a_logged_miss(tmp_path, caplog, mode, how):
    uri = f"file://{tmp_path}?sync={mode}"
    with mlxcache.open_backend(uri) as b:
        b.put_many([(f"k{i}", rec(i)) for i in range(4)])
        b.put("single", rec(9))
    damage(tmp_path / "data" / rows(tmp_path)["k2"], how)
    caplog.clear()
    with mlxcache.open_backend(uri) as b, caplog.at_level(logging.WARNING, logger="mlxcache"):
        got = b.get_many(["k0", "k1", "k2", "k3", "single"])
        assert got[2] is None and "'k2'" in caplog.text
        for i, r in zip([0, 1, 3, 9], [got[0], got[1], got[3], got[4]], strict=True):
            assert r is not None and bits(r.arrays["a"]) == bits(rec(i).arrays["a"])
        stats = b.stats()
        assert stats["errors"] == 1 and stats["entries"] == 4 and "k2" not in b
        b.put("k2", rec(2))  # stored again, as the prefix cache would on its next store
        assert bits(b.get("k2").arrays["a"]) == bits(rec(2).arrays["a"])


class Syncs:
    """Counts real fsyncs and batch syncs (they still run: a spy, not a stand-in)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fsync = self.batch = 0
        real_fsync, real_all = os.fsync, disk_writes.sync_all

        def fsync(fd: int) -> None:
            self.fsync += 1
            real_fsync(fd)

        def sync_all(*args: object) -> None:
            self.batch += 1
            real_all(*args)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(disk_writes, "sync_all", sync_all)


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_syncs_as_documented(tmp_path, monkeypatch, mode):
    b = DiskBackend(tmp_path, sync=mode)
    b.put("warm", rec(0))  # creates the index connection and a first shard folder
    syncs = Syncs(monkeypatch)
    b.put_many([(f"k{i}", rec(i)) for i in range(8)])
    many = (syncs.fsync, syncs.batch)
    b.put("one", rec(1))
    one = (syncs.fsync - many[0], syncs.batch - many[1])
    if mode == "always":  # per file: the file and its folder (a new shard folder: its parent)
        assert many[0] >= 16 and many[1] == 0 and one[0] >= 2 and one[1] == 0
    elif mode == "batch":  # one sync for the batch; a single put as always syncs it
        assert many[1] == 1 and many[0] <= 16 and one[0] >= 2 and one[1] == 0
        if durable._SYNCFS is not None:
            assert many[0] == 0  # Linux: one syncfs, no fsync at all
    else:
        assert many == (0, 0) and one == (0, 0)
    assert len(b) == 10 and b.stats()["errors"] == 0


def test_put_many_publishes_every_row_in_one_transaction(tmp_path):
    b = DiskBackend(tmp_path, sync="batch")
    b.put("warm", rec(0))
    db = sqlite3.connect(tmp_path / "index.sqlite", isolation_level=None)
    before = db.execute("PRAGMA data_version").fetchone()[0]
    b.put_many([(f"k{i}", rec(i)) for i in range(8)])
    after = db.execute("PRAGMA data_version").fetchone()[0]
    assert after == before + 1 and len(b) == 9  # one commit by another connection
    db.close()


def test_one_failed_file_leaves_the_rest_of_the_batch(tmp_path, monkeypatch, caplog):
    b = DiskBackend(tmp_path, sync="batch")
    real = disk_writes.write_file
    calls = [0]

    def full_once(path, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, *args, **kwargs)

    monkeypatch.setattr(disk_writes, "write_file", full_once)
    with caplog.at_level(logging.WARNING, logger="mlxcache"):
        b.put_many([(f"k{i}", rec(i)) for i in range(4)])
    assert [f"k{i}" in b for i in range(4)] == [True, False, True, True]
    assert b.stats()["errors"] == 1 and "No space left" in caplog.text
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_failed_batch_sync_publishes_nothing_and_leaves_no_file(tmp_path, monkeypatch):
    b = DiskBackend(tmp_path, sync="batch")
    b.put("old", rec(0))

    def eio(*args: object) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(disk_writes, "sync_all", eio)
    b.put_many([(f"k{i}", rec(i)) for i in range(3)])
    assert len(b) == 1 and b.stats()["errors"] == 3 and "Input/output" in b.last_error
    assert len(list((tmp_path / "data").rglob("*.safetensors"))) == 1
    assert list((tmp_path / "tmp").iterdir()) == []


def test_the_option_is_checked_and_shown(tmp_path):
    assert mlxcache.open_backend(f"file://{tmp_path}").stats()["sync"] == disk_writes.DEFAULT_SYNC
    assert mlxcache.open_backend(f"file://{tmp_path}?sync=never").stats()["sync"] == "never"
    with pytest.raises(ValueError, match="sync"):
        mlxcache.open_backend(f"file://{tmp_path}?sync=sometimes")
    with pytest.raises(ValueError, match="sync"):
        DiskBackend(tmp_path, sync="fast")
