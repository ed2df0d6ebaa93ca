"""``mlxcache serve --engine mlx-vlm`` answers what ``mlx_vlm.server`` with its cache off answers
(f), images keyed by content and in order; bad input exits non-zero before any port opens."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from redis_server import free_port
from vlm_server import VlmServer

from mlxcache.cli.serve import pick_engine
from mlxcache.tiny_models import build_tiny_lm, build_tiny_vlm

ORDERS = (["A", "B"], ["B", "A"], ["A"], ["B"], ["B", "A"], ["A"], ["C"])


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    return str(build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny"))


def test_answers_equal_mlx_vlm_without_cache(tiny_vlm, tmp_path):
    plain = VlmServer(tiny_vlm, None, tmp_path / "plain.log", plain=True)
    try:
        want = {tuple(images): plain.chat(images)[:2] for images in ORDERS}
    finally:
        plain.kill()
    assert want[("A",)][0] != want[("B",)][0]  # the answer depends on the image
    cached = VlmServer(
        tiny_vlm, f"file://{tmp_path}/c", tmp_path / "c.log", "--cache-block-size", "16"
    )
    try:
        got = [(tuple(images), cached.chat(images)) for images in ORDERS]
    finally:
        cached.kill()
    for images, (text, n, _) in got:
        assert (text, n) == want[images], images
    hits = {images: hit for images, (_, _, hit) in got}
    first_ba = got[1][1][2]
    assert first_ba < want[("B", "A")][1] // 2  # [A, B]'s prefix is not served for [B, A]
    assert hits[("B", "A")] == want[("B", "A")][1] - 1  # its repeat is
    assert got[3][1][2] < want[("B",)][1] // 2  # A's prefix is not served for B


def run_serve(*args: str, **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ, HF_HUB_OFFLINE="1", **env)
    return subprocess.run(
        [sys.executable, "-m", "mlxcache", "serve", *args],
        capture_output=True,
        text=True,
        env=full,
        timeout=120,
    )


def test_bad_input_exits_before_a_port_opens(tiny_vlm, tmp_path):
    port = ("--host", "127.0.0.1", "--port", str(free_port()))
    out = run_serve("--engine", "mlx-tpu", "--model", tiny_vlm, *port)
    assert out.returncode != 0 and "unknown engine 'mlx-tpu'" in out.stderr
    # no --engine: the config picks mlx-vlm and says so; a wrong URI is one line, exit 1
    out = run_serve("--model", tiny_vlm, "--cache", "nosuch://x", *port)
    assert out.returncode == 1
    assert "engine mlx-vlm" in out.stdout and "nosuch" in out.stderr
    assert "Uvicorn running" not in out.stderr + out.stdout
    # a model mlx-vlm cannot load
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(
        json.dumps({"model_type": "no_such_arch", "vision_config": {}})
    )
    out = run_serve(
        "--engine",
        "mlx-vlm",
        "--model",
        str(broken),
        "--cache",
        f"file://{tmp_path}/c",
        *port,
    )
    assert out.returncode == 1 and "cannot load" in out.stderr
    out = run_serve("--engine", "mlx-vlm", "--model", str(tmp_path / "missing"), *port)
    assert out.returncode == 1 and "no such folder" in out.stderr


def test_engine_picked_from_config(tiny_vlm, tmp_path):
    lm = build_tiny_lm(tmp_path / "lm")
    assert pick_engine(json.loads((lm / "config.json").read_text())) == "mlx-lm"
    with open(os.path.join(tiny_vlm, "config.json")) as f:
        assert pick_engine(json.load(f)) == "mlx-vlm"
