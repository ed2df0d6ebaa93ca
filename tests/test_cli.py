"""The mlxcache command: every subcommand and its error paths, on real file:// caches."""

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

import mlxcache
from mlxcache import Record
from mlxcache.cli import main
from mlxcache.records.digests import FORMAT_VERSION


def fill(uri: str, n: int = 3, size: int = 256) -> None:
    with mlxcache.open_backend(uri) as b:
        for i in range(n):
            b.put(f"k/{i}", Record({"x": mx.full((size,), i, dtype=mx.bfloat16)}, {"i": i}))


@pytest.fixture
def cache_uri(tmp_path) -> str:
    uri = f"file://{tmp_path / 'cache'}"
    fill(uri)
    return uri


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_stats_json(capsys, cache_uri):
    code, out, _ = run(capsys, "stats", cache_uri, "--json")
    stats = json.loads(out)
    assert code == 0 and stats["entries"] == 3 and stats["bytes"] > 3 * 512


def test_ls_with_prefix(capsys, cache_uri):
    fill(cache_uri.replace("cache", "cache"), n=0)
    with mlxcache.open_backend(cache_uri) as b:
        b.put("other", Record({"x": mx.zeros(1)}))
    code, out, _ = run(capsys, "ls", cache_uri, "--prefix", "k/")
    assert code == 0 and out.split() == ["k/0", "k/1", "k/2"]
    code, out, _ = run(capsys, "ls", cache_uri, "--json")
    assert json.loads(out) == ["k/0", "k/1", "k/2", "other"]


def test_inspect_shows_header_and_missing_key_fails(capsys, cache_uri):
    code, out, _ = run(capsys, "inspect", cache_uri, "k/1", "--json")
    info = json.loads(out)
    assert code == 0
    assert info["format_version"] == FORMAT_VERSION and info["meta"] == {"i": 1}
    assert info["tensors"] == [{"name": "x", "dtype": "BF16", "shape": [256], "bytes": 512}]
    code, out, _ = run(capsys, "inspect", cache_uri, "k/1")
    assert code == 0 and "BF16" in out and "checksum: xxh3_128:" in out
    code, _, err = run(capsys, "inspect", cache_uri, "nope")
    assert code == 1 and err.strip() == "mlxcache: error: no such key: nope"


def test_rm(capsys, cache_uri):
    assert run(capsys, "rm", cache_uri, "k/0")[0] == 0
    code, _, err = run(capsys, "rm", cache_uri, "k/0")
    assert code == 1 and "no such key: k/0" in err
    with mlxcache.open_backend(cache_uri) as b:
        assert sorted(b.keys()) == ["k/1", "k/2"]


def test_clear_needs_yes_without_a_terminal(capsys, cache_uri, monkeypatch):
    monkeypatch.setattr(sys, "stdin", open("/dev/null"))
    code, _, err = run(capsys, "clear", cache_uri)
    assert code == 1 and "--yes" in err
    with mlxcache.open_backend(cache_uri) as b:
        assert len(b) == 3
    assert run(capsys, "clear", cache_uri, "--yes")[0] == 0
    with mlxcache.open_backend(cache_uri) as b:
        assert len(b) == 0


def test_gc_trims_to_budget(capsys, cache_uri):
    code, out, _ = run(capsys, "gc", cache_uri, "--max-bytes", "1500", "--json")
    result = json.loads(out)
    assert code == 0 and result["bytes_after"] <= 1500 < result["bytes_before"]
    code, _, err = run(capsys, "gc", cache_uri, "--max-bytes", "lots")
    assert code == 1 and "invalid size" in err


def test_copy_between_caches_is_bit_exact(capsys, cache_uri, tmp_path):
    dst = f"file://{tmp_path / 'copy'}"
    code, out, err = run(capsys, "copy", cache_uri, dst, "--json")
    result = json.loads(out)
    assert code == 0 and (result["copied"], result["keys"], result["not_kept"]) == (3, 3, [])
    assert err == ""  # no progress bar when not on a terminal
    with mlxcache.open_backend(cache_uri) as a, mlxcache.open_backend(dst) as b:
        for key in a.keys():
            x, y = a.get(key).arrays["x"], b.get(key).arrays["x"]
            assert bytes(memoryview(x)) == bytes(memoryview(y))


def test_verify_reports_a_corrupt_record(capsys, cache_uri, tmp_path):
    code, out, _ = run(capsys, "verify", cache_uri, "--json")
    result = json.loads(out)
    assert code == 0 and (result["checked"], result["good"], result["bad"]) == (3, 3, [])
    files = sorted((tmp_path / "cache").rglob("*.safetensors"))
    assert len(files) == 3
    victim = files[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    code, out, _ = run(capsys, "verify", cache_uri)
    assert code == 1 and "1 bad" in out and "bad (removed)" in out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["stats", "s3://bucket"], "unknown cache URI"),
        (["stats", "memory://?max_byte=1"], "unknown option(s) for memory://: max_byte"),
        (["stats", "redis://127.0.0.1:1/0?timeout=0.2", "--json"], "failed: redis cache"),
        (["ls", "redis://127.0.0.1:1/0?timeout=0.2"], "failed: redis cache"),
    ],
)
def test_errors_are_one_line_and_exit_1(argv, message):
    proc = subprocess.run(
        [sys.executable, "-m", "mlxcache", *argv], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1  # one line, naming the cause
    assert proc.stderr.startswith("mlxcache: error:")


def test_console_script_is_declared():
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert 'mlxcache = "mlxcache.cli:main"' in text


def test_demo_subcommand_runs_cold_then_warm_in_a_new_process(capsys, tmp_path):
    uri = f"file://{tmp_path / 'demo'}"
    code, out, err = run(
        capsys, "demo", "--cache", uri, "--prompt-tokens", "96", "--max-tokens", "2"
    )
    assert code == 0
    assert "same again" in out and "matches cold" in out and "matches uncached" in out
    assert "mlxcache demo [1/3]: building the tiny Qwen2-VL" in err  # phases, as plain lines
    assert "mlxcache demo [3/3]: a new process" in err
    with mlxcache.open_backend(uri) as b:
        assert len(b) == 0  # the demo removes its own entries
    assert list((tmp_path / "demo" / "data").iterdir()) == []  # no empty shard folders left


def test_demo_lm_serves_warm_after_a_restart(capsys, tmp_path):
    uri = f"file://{tmp_path / 'demo-lm'}"
    args = ("demo", "--model-kind", "lm", "--cache", uri, "--prompt-tokens", "96")
    code, out, err = run(capsys, *args, "--max-tokens", "3")
    assert code == 0, out + err
    assert "matches cold" in out and "matches uncached" in out and "after SIGKILL" in out
    with mlxcache.open_backend(uri) as b:
        assert len(b) == 0  # the demo removes its own entries


def test_demo_errors(capsys):
    code, _, err = run(capsys, "demo", "--prompt-tokens", "8")
    assert code == 1 and "--prompt-tokens must be >= 64" in err
    assert (
        run(capsys, "demo", "--cache", "memory://")[0] == 2
    )  # one process cannot show warm starts


def test_inspect_and_gc_on_redis(capsys, redis_url):
    fill(redis_url)
    code, out, _ = run(capsys, "inspect", redis_url, "k/2", "--json")
    info = json.loads(out)
    assert code == 0 and info["meta"] == {"i": 2} and info["tensors"][0]["dtype"] == "BF16"
    code, out, _ = run(capsys, "gc", redis_url, "--max-bytes", "1500", "--json")
    result = json.loads(out)
    assert code == 0 and result["bytes_after"] <= 1500 < result["bytes_before"]
    code, out, _ = run(capsys, "ls", redis_url, "--json")
    assert json.loads(out) == ["k/1", "k/2"]  # the least recently used entry went first
