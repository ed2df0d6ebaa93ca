"""``mlxcache serve`` before any port opens: the engine picked from the model's config.json, a bad
model, a busy port, the help. Each case runs the real command as a subprocess, with no network
(``HF_HUB_OFFLINE=1``) and nothing downloaded; a failure is exit 1 and one line on stderr."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from redis_server import free_port
from vllm_servers import VLLM_PYTHON

from mlxcache.tiny_models import build_tiny_lm

ROOT = Path(__file__).resolve().parent.parent
PYTHONS = {"mlx-lm": sys.executable, "mlx-vlm": sys.executable, "vllm-mlx": VLLM_PYTHON}


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory) -> str:
    return str(build_tiny_lm(tmp_path_factory.mktemp("lm") / "tiny"))


@pytest.fixture(scope="module")
def no_weights(tmp_path_factory) -> str:
    """A folder with a (text model's) config.json and no weights: no engine can load it."""
    folder = tmp_path_factory.mktemp("bad") / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return str(folder)


def serve(*args: str, python: str = sys.executable, hf_home: Path | None = None, timeout=120):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if hf_home is not None:
        env["HF_HOME"] = str(hf_home)
    return subprocess.run(
        [python, "-m", "mlxcache", "serve", *args],
        capture_output=True, text=True, timeout=timeout, env=env,
    )  # fmt: skip


def one_line(run: subprocess.CompletedProcess) -> str:
    """The run failed with exit 1 and exactly one line on stderr: that line."""
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1 and len(lines) == 1, (run.returncode, run.stderr)
    return lines[0]


def nothing_listens(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def fake_hub_cache(home: Path, repo: str, config: dict) -> None:
    """``repo``'s config.json in the Hugging Face cache layout under ``home`` (HF_HOME)."""
    folder = home / "hub" / ("models--" + repo.replace("/", "--"))
    commit = "0" * 40
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    (folder / "snapshots" / commit).mkdir(parents=True)
    (folder / "snapshots" / commit / "config.json").write_text(json.dumps(config))


@pytest.fixture
def busy_port():
    """A port this test listens on, as another server would."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_repo_id_in_the_hub_cache_picks_the_engine_from_its_config(tmp_path, busy_port):
    """Only config.json is read (from the cache: offline); the pick is printed before the port
    check, which then fails on the port this test holds."""
    fake_hub_cache(tmp_path, "org/tiny-vlm", {"model_type": "qwen2_vl", "vision_config": {}})
    fake_hub_cache(tmp_path, "org/tiny-lm", {"model_type": "llama"})
    for repo, engine, has in (("org/tiny-vlm", "mlx-vlm", "has a"),
                              ("org/tiny-lm", "mlx-lm", "has no")):  # fmt: skip
        run = serve("--model", repo, "--port", str(busy_port), hf_home=tmp_path)
        assert one_line(run) == f"mlxcache: error: cannot listen on 127.0.0.1:{busy_port}: " + (
            "address already in use"
        )
        assert run.stdout.splitlines() == [
            f"mlxcache serve: engine {engine} (the model's config.json {has} vision_config)"
        ]


def test_a_repo_id_offline_and_not_cached_is_one_line(tmp_path):
    port = free_port()
    run = serve("--model", "org/not-downloaded", "--port", str(port), hf_home=tmp_path)
    line = one_line(run)
    assert line.startswith("mlxcache: error: --model org/not-downloaded: its config.json is not ")
    assert "offline" in line and line.endswith("--engine vllm-mlx to choose")
    assert run.stdout == "" and nothing_listens(port)


def test_no_such_folder_is_one_line():
    run = serve("--model", "/no/such/dir", "--port", str(free_port()))
    assert one_line(run) == "mlxcache: error: --model /no/such/dir: no such folder"


@pytest.mark.parametrize("engine", ["mlx-lm", "mlx-vlm", "vllm-mlx"])
def test_a_model_no_engine_can_load_is_one_line_and_no_port(engine, no_weights, tmp_path):
    """A folder without weights, and (with --engine) an id offline and not cached."""
    port = free_port()
    common = ("--engine", engine, "--port", str(port), "--cache", f"file://{tmp_path}/c")
    python = PYTHONS[engine]
    run = serve(*common, "--model", no_weights, python=python)
    line = one_line(run)
    assert line.startswith(f"mlxcache: error: --model {no_weights}: {engine} cannot load it: ")
    run = serve(*common, "--model", "org/not-downloaded", python=python, hf_home=tmp_path)
    assert one_line(run).endswith("cannot be reached (offline)")  # no --engine hint: it has one
    assert nothing_listens(port)


@pytest.mark.parametrize("engine", ["mlx-lm", "mlx-vlm", "vllm-mlx"])
def test_a_busy_port_is_one_line_naming_the_address(engine, tiny_lm, busy_port, tmp_path):
    run = serve(
        "--engine", engine, "--model", tiny_lm, "--port", str(busy_port),
        "--cache", f"file://{tmp_path}/c", python=PYTHONS[engine],
    )  # fmt: skip
    assert one_line(run) == (
        f"mlxcache: error: cannot listen on 127.0.0.1:{busy_port}: address already in use"
    )


def test_help_names_every_engine_and_the_default_cache_without_mlx_lm():
    code = (
        "import sys\n"
        "sys.modules['mlx_lm'] = None  # as if it were not installed\n"
        "from mlxcache.cli import main\n"
        "sys.exit(main(['serve', '--help']))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    wanted = ["--engine {mlx-lm,mlx-vlm,vllm-mlx}", "mlx-vlm ", "vllm-mlx ", "default 127.0.0.1"]
    wanted += ["else file://~/.cache/mlxcache?max_bytes=20GiB", "pip install 'mlxcache[lm]'"]
    for text in wanted:
        assert text in run.stdout, (text, run.stdout)


def test_each_engines_help_says_the_default_cache():
    from mlxcache.integrations.mlx_vlm.server import _options

    default = "file://~/.cache/mlxcache?max_bytes=20GiB)"
    assert default in " ".join(_options().format_help().split())  # was "else the folder"
    run = serve("--engine", "vllm-mlx", "--help")  # not in this venv: help still answers
    assert run.returncode == 0, run.stderr
    assert default in " ".join(run.stdout.split()) and "vllm-mlx is not installed" in run.stdout
    top = subprocess.run(
        [sys.executable, "-m", "mlxcache", "--help"], capture_output=True, text=True
    )
    assert "vllm-mlx" in top.stdout and "mlx-vlm" in top.stdout


def test_mlx_lm_loads_the_model_before_its_port_opens(no_weights, tmp_path):
    """Weights mlx-lm cannot read: one line and exit 1, not a server answering 404 forever."""
    folder = tmp_path / "junk"
    folder.mkdir()
    (folder / "config.json").write_text(Path(no_weights, "config.json").read_text())
    (folder / "model.safetensors").write_bytes(b"not safetensors")
    port = free_port()
    run = serve("--model", str(folder), "--port", str(port), "--cache", f"file://{tmp_path}/c")
    assert one_line(run).startswith(f"mlxcache: error: --model {folder}: mlx-lm cannot load it: ")
    assert f"will listen on http://127.0.0.1:{port}" in run.stdout and nothing_listens(port)
