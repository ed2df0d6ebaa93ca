"""file:// caches are private whatever the umask: folders 0700, files 0600, index included;
``shared_group=true`` opens them to the group on purpose."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from helpers import sample_record

import mlxcache


@pytest.fixture(params=[0o022, 0o000, 0o077])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def modes(root: Path) -> dict[str, int]:
    """Permission bits of everything under ``root`` (and root itself), by relative path."""
    out = {".": stat.S_IMODE(root.stat().st_mode)}
    for path in root.rglob("*"):
        out[str(path.relative_to(root))] = stat.S_IMODE(path.stat().st_mode)
    return out


def _fill(uri: str, root: Path):
    b = mlxcache.open_backend(uri)
    b.put("a", sample_record())
    b.put("b", sample_record(2))
    victim = next((root / "data").rglob("*.safetensors"))
    victim.write_bytes(b"garbage")  # read -> quarantined
    b.get_many(["a", "b"])
    b.close()
    (root / "index.sqlite").write_bytes(b"not a database")  # reopen -> index quarantined
    b = mlxcache.open_backend(uri)
    b.put("c", sample_record(3))
    return b  # open: its -wal and -shm files exist


def test_everything_is_private_whatever_the_umask(tmp_path, umask):
    root = tmp_path / "cache"
    b = _fill(f"file://{root}", root)
    found = modes(root)
    b.close()
    assert any(k.startswith("quarantine/") and k.endswith(".safetensors") for k in found)
    assert any(k.startswith("quarantine/index-") for k in found)
    assert {"index.sqlite", "index.sqlite-wal", "index.sqlite-shm"} <= set(found)
    for name, mode in found.items():
        is_dir = (root / name).is_dir()
        assert mode == (0o700 if is_dir else 0o600), (oct(umask), name, oct(mode))


def test_shared_group_opens_the_cache_to_the_group(tmp_path, umask):
    root = tmp_path / "cache"
    b = _fill(f"file://{root}?shared_group=true", root)
    found = modes(root)
    b.close()
    assert "index.sqlite-shm" in found
    for name, mode in found.items():
        is_dir = (root / name).is_dir()
        assert mode == (0o2770 if is_dir else 0o660), (oct(umask), name, oct(mode))


def test_an_old_world_readable_cache_is_tightened(tmp_path):
    root = tmp_path / "cache"
    old = os.umask(0o022)
    try:
        for sub in ("data", "tmp", "quarantine"):
            (root / sub).mkdir(parents=True, mode=0o755)
        (root / "index.sqlite").touch(mode=0o644)
        mlxcache.open_backend(f"file://{root}").put("k", sample_record())
    finally:
        os.umask(old)
    found = modes(root)
    found.pop(".")  # a folder the user made stays as they made it
    for name, mode in found.items():
        assert mode == (0o700 if (root / name).is_dir() else 0o600), (name, oct(mode))


def test_opening_another_backend_keeps_this_processs_sqlite_locks(tmp_path):
    """Found by the signing test: setting the index's mode by opening it dropped the POSIX
    locks SQLite holds for another backend of this process; after a write by another process
    and deletes by a third backend, the first one still saw the deleted entries."""
    from helpers import run_py

    uri = f"file://{tmp_path}"
    first = mlxcache.open_backend(uri)
    first.put("a", sample_record())
    assert first.get("a") is not None
    others = [mlxcache.open_backend(uri) for _ in range(3)]  # each open sets the modes
    run_py(
        """
        import sys, mlxcache
        from mlxcache import Record
        b = mlxcache.open_backend(sys.argv[1])
        for i in range(5):
            b.put(f"p{i}", Record({}, {"i": i}))
        """,
        uri,
    )
    third = mlxcache.open_backend(uri)
    for key in list(third.keys()):
        third.delete(key)
    assert list(third.keys()) == []
    assert list(first.keys()) == [] and len(first) == 0 and "p1" not in first
    for b in (*others, third):
        b.close()
