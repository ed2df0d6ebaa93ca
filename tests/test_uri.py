"""Backend URIs: schemes, options and their errors."""

import os
import subprocess
import sys

import pytest
from backend_factories import PLUGIN_DIR
from helpers import run_py

import mlxcache
from mlxcache.options import parse_size


@pytest.mark.parametrize(
    "text,expected",
    [("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30), ("1.5GB", 1_500_000_000), ("1024", 1024),
     (4096, 4096), ("10 kb", 10_000)],
)  # fmt: skip
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "bad", ["12XB", "-1", "", "GiB", True, "9" * 400, float("inf"), float("nan"), -1.0]
)
def test_bad_sizes(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_absurd_size_option_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="max_bytes"):
        mlxcache.open_backend("memory://", max_bytes=float("inf"))


def test_unknown_scheme_lists_valid_ones():
    with pytest.raises(ValueError, match="memory://.*redis://"):
        mlxcache.open_backend("s3://bucket/x")


def test_unknown_option_names_it_and_lists_valid_ones():
    with pytest.raises(
        ValueError, match="max_byte.*valid options: idle_ttl, max_bytes, max_entries, pin_max_bytes"
    ):
        mlxcache.open_backend("memory://?max_byte=1")


def test_keyword_options_override_query():
    b = mlxcache.open_backend("memory://?max_bytes=1", max_bytes="1KiB")
    assert b.stats()["max_bytes"] == 1024


def test_register_scheme():
    mlxcache.register_scheme("mem2", lambda url, opts: mlxcache.open_backend("memory://"))
    assert isinstance(mlxcache.open_backend("mem2://"), mlxcache.CacheBackend)
    with pytest.raises(ValueError, match="already registered"):
        mlxcache.register_scheme("mem2", "somewhere:else")
    with pytest.raises(ValueError, match="already registered"):
        mlxcache.register_scheme("file", "somewhere:else")
    mlxcache.register_scheme(
        "mem2", lambda url, opts: mlxcache.open_backend("memory://"), replace=True
    )
    with pytest.raises(ValueError, match="invalid scheme"):
        mlxcache.register_scheme("no spaces", "x:y")


PLUGIN_ENV = {"PYTHONPATH": os.pathsep.join([str(PLUGIN_DIR), os.environ.get("PYTHONPATH", "")])}


def test_an_installed_entry_point_adds_a_scheme_to_open_backend_and_the_cli(tmp_path):
    """The mlxcache.backends entry point of tests/plugin (a .dist-info on the path)."""
    out = run_py(
        """
        import mlxcache
        from mlxcache.uri import schemes
        b = mlxcache.open_backend("dict://?max_bytes=1MiB")
        print(type(b).__module__, "dict" in schemes(), b.stats()["max_bytes"])
        """,
        env=PLUGIN_ENV,
    )
    assert out.split() == ["mlxcache_dictstore", "True", str(2**20)]
    cli = subprocess.run(
        [sys.executable, "-m", "mlxcache", "stats", "dict://", "--json"],
        capture_output=True, text=True, timeout=60, env={**os.environ, **PLUGIN_ENV},
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    assert '"backend": "dict"' in cli.stdout
    without = subprocess.run(
        [sys.executable, "-m", "mlxcache", "stats", "dict://"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert without.returncode == 1 and "unknown cache URI" in without.stderr


def test_an_entry_point_cannot_take_a_built_in_scheme(tmp_path):
    dist = tmp_path / "evil-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: evil\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[mlxcache.backends]\nfile = evil:from_uri\n")
    out = run_py(
        """
        import logging, sys, mlxcache
        logging.basicConfig()
        b = mlxcache.open_backend("file://" + sys.argv[1])
        print(type(b).__name__)
        """,
        str(tmp_path / "cache"),
        env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
    )
    assert out.strip() == "DiskBackend"


def test_a_uri_without_slashes_or_a_bare_path_says_what_to_write(tmp_path):
    """The CLI quotes what was given (not a normalised URI) and the URI to write instead."""
    cases = {
        "file:/tmp/x": "cache URI 'file:/tmp/x' has no '//' after 'file:': write file:///tmp/x",
        "redis:u:pw@h:6379": "cache URI 'redis:***@h:6379' has no '//' after 'redis:': "
        "write redis://u:***@h:6379",
        str(tmp_path / "c"): f"cache URI '{tmp_path}/c' is a path, not a URI: write "
        f"file://{tmp_path}/c (or one of ",
        "memory": "cache URI 'memory' is a scheme alone: write memory://...",
        "s3://bucket": "unknown cache URI scheme 's3://' in 's3://bucket': use one of file://, ",
    }
    for given, said in cases.items():
        run = subprocess.run(
            [sys.executable, "-m", "mlxcache", "stats", given],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 1 and len(lines) == 1, run.stderr
        assert lines[0].startswith(f"mlxcache: error: {said}"), lines[0]
    assert not (tmp_path / "c").exists()  # nothing was created
