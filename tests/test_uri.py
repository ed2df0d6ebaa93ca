"""Backend URIs: schemes, options and their errors."""

import pytest

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
    with pytest.raises(ValueError, match="max_byte.*valid options: max_bytes, max_entries"):
        mlxcache.open_backend("memory://?max_byte=1")


def test_keyword_options_override_query():
    b = mlxcache.open_backend("memory://?max_bytes=1", max_bytes="1KiB")
    assert b.stats()["max_bytes"] == 1024


def test_register_scheme():
    mlxcache.register_scheme("mem2", lambda url, opts: mlxcache.open_backend("memory://"))
    assert isinstance(mlxcache.open_backend("mem2://"), mlxcache.CacheBackend)
