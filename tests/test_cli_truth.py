"""The installed mlxcache command never reports a success it did not have (issue 12).

Every test runs the real console script in a subprocess and checks its exit code and its
one stderr line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from helpers import run_py
from redis_server import free_port

import mlxcache
from mlxcache import Record

MLXCACHE = shutil.which("mlxcache", path=os.path.dirname(sys.executable)) or "mlxcache"


def cli(*argv: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [MLXCACHE, *argv], capture_output=True, text=True, timeout=120,
        env={**os.environ, **(env or {})}, **kw,
    )  # fmt: skip


def one_error_line(proc: subprocess.CompletedProcess, *words: str) -> str:
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlxcache: error:"), proc.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def fill(uri: str, n: int = 3, size: int = 256) -> None:
    with mlxcache.open_backend(uri) as b:
        for i in range(n):
            tokens = mx.arange(40, dtype=mx.int64)
            mx.eval(tokens)
            meta = {"i": i, "tokens": bytes(memoryview(tokens))}
            b.put(f"k/{i}", Record({"x": mx.full((size,), i, dtype=mx.bfloat16)}, meta))


@pytest.fixture
def cache(tmp_path) -> str:
    uri = f"file://{tmp_path / 'cache'}"
    fill(uri)
    return uri


def test_the_console_script_is_the_installed_one():
    assert os.path.isabs(MLXCACHE) and cli("--version").stdout.strip().startswith("mlxcache ")


def test_verify_of_an_unreachable_redis_fails():
    proc = cli("verify", f"redis://127.0.0.1:{free_port()}/0")
    one_error_line(proc, "unreachable", "during keys")
    assert "retrying" not in proc.stderr and "checked" not in proc.stdout


def test_copy_reports_what_the_destination_kept(cache, tmp_path):
    proc = cli("copy", cache, f"file://{tmp_path / 'small'}?max_bytes=100")
    one_error_line(proc, "kept 0 of 3")
    assert "copied 0 of 3" in proc.stdout


@pytest.mark.parametrize("command", ["stats", "ls", "verify", "inspect"])
def test_read_only_commands_never_create_a_cache(tmp_path, command):
    missing = tmp_path / "typo"
    argv = [command, f"file://{missing}"] + (["k/0"] if command == "inspect" else [])
    one_error_line(cli(*argv), "no cache at", str(missing))
    assert not missing.exists()


def _freeze(path: Path) -> None:
    """Make a folder read-only even for root (the immutable attribute), or by its mode."""
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-R", "+i", str(path)], check=True)
    else:
        for p in [path, *path.rglob("*")]:
            p.chmod(0o555 if p.is_dir() else 0o444)


def _thaw(path: Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-R", "-i", str(path)], check=True)
    else:
        for p in [path, *path.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)


def test_a_read_only_folder_can_be_listed_inspected_and_verified(cache, tmp_path):
    folder = tmp_path / "cache"
    before = sorted(p.name for p in folder.rglob("*"))
    _freeze(folder)
    try:
        assert cli("ls", cache).stdout.split() == ["k/0", "k/1", "k/2"]
        inspect = cli("inspect", cache, "k/1")
        assert (
            inspect.returncode == 0 and "40 tokens [0, 1, 2, 3, 4, 5, 6, 7, ...]" in inspect.stdout
        )
        assert json.loads(cli("stats", cache, "--json").stdout)["entries"] == 3
        verify = cli("verify", cache)
        assert verify.returncode == 0 and "checked 3 entries" in verify.stdout
        assert "not writable" in verify.stderr
        proc = cli("rm", cache, "k/0")  # a write: refused with one line, exit 1
        one_error_line(proc)
    finally:
        _thaw(folder)
    assert sorted(p.name for p in folder.rglob("*")) == before  # nothing created or removed


def test_verify_says_what_it_removed(cache, tmp_path):
    victim = sorted((tmp_path / "cache").rglob("*.safetensors"))[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    first = cli("verify", cache, "--json")
    report = json.loads(first.stdout)
    assert first.returncode == 1 and len(report["bad"]) == 1 and report["bad_entries"] == "removed"
    assert "checksum" in next(iter(report["reasons"].values()))
    second = cli("verify", cache)
    assert second.returncode == 0 and "checked 2 entries" in second.stdout  # it was removed


def test_demo_without_the_vlm_extra_says_what_to_install():
    code = """
        import sys
        sys.modules["mlx_vlm"] = None  # as if the vlm extra were not installed
        from mlxcache.cli import main
        sys.exit(main(["demo"]))
    """
    proc = run_py(code, check=False)
    one_error_line(proc, "pip install 'mlxcache[vlm]'")


def test_a_closed_pipe_is_no_traceback(tmp_path):
    uri = f"file://{tmp_path / 'many'}"
    fill(uri, n=300, size=1)
    proc = subprocess.run(
        f"'{MLXCACHE}' ls '{uri}' | head -1", shell=True, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.stdout.strip() == "k/0" and proc.stderr == ""


def test_verbose_anywhere_and_help_for_every_argument(cache):
    assert cli("stats", cache, "-v").returncode == 0 and cli("-v", "stats", cache).returncode == 0
    top = cli("--help").stdout
    assert "``" not in top and "file://~/.cache/mlxcache" in top
    from mlxcache.cli.app import build_parser

    parser = build_parser()
    subs = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in subs.items():
        for action in sub._actions:
            assert action.help, f"mlxcache {name}: {action.dest} has no help"


def test_redis_errors_name_the_command_and_fail_fast():
    proc = cli("ls", f"redis://user:hunter2@127.0.0.1:{free_port()}/0")
    line = one_error_line(proc, "during keys")
    assert "hunter2" not in proc.stderr + proc.stdout and "user:***@" in line
