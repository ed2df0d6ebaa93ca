"""The model-family matrix (docs/models.md): every family's answer is the engine's, bit for bit.

Each family runs cold, warm, extended, branched (twice with state layers) and image-B prompts
through mlxcache on a ``file://`` store and compares every answer with mlx-vlm's own uncached
``generate_step`` (resumed at the same splits, for recurrent layers); then one new process per
run checks a warm repeat of every family from the stores. A refused family must give the
engine's answer and say why once.
"""

from __future__ import annotations

import importlib
import json
import logging
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx_vlm")

import families  # noqa: E402
from families import harness  # noqa: E402

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def _specs() -> dict[str, harness.Spec]:
    specs = {}
    for info in pkgutil.iter_modules(families.__path__):
        if info.name.startswith("specs_"):
            module = importlib.import_module(f"families.{info.name}")
            specs.update({s.name: s for s in module.SPECS})
    return specs


SPECS = _specs()


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


def _uri(stores: Path, name: str) -> str:
    return f"file://{stores / name}"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_family_answers_like_the_engine(name, stores, caplog):
    spec = SPECS[name]
    with caplog.at_level(logging.INFO, logger="mlxcache"):
        r = harness.scenarios(spec, _uri(stores, name))
    for case, got in r.items():
        assert got["exact"], (case, got)  # never a different answer
    told = [m for m in caplog.messages if "own path" in m]
    n = harness.PROMPT
    if spec.expect == "refused":
        assert all(got["cached"] == 0 and not got["cached_flag"] for got in r.values())
        assert len(told) == 1 and spec.reason in told[0], told  # once per model load
        return
    if spec.expect == "repeat":  # prefilled in one pass: only an exact repeat of a whole prompt
        assert r["warm"]["cached"] == harness.PROMPT, r["warm"]
        assert all(got["cached"] == 0 for case, got in r.items() if case != "warm"), r
        assert len(told) == 1 and spec.reason in told[0], told  # once per model load
        return
    assert not told, told
    if spec.extra.get("expands"):  # keyed in embedding positions: the image's rows count
        n = r["warm"]["positions"]
        assert n > harness.PROMPT, r["warm"]
    assert all(got["positions"] == n for case, got in r.items() if case != "extended")
    assert r["cold"]["cached"] == 0
    assert r["warm"]["cached"] == n - 1  # a repeat restores all but the last token
    assert r["extended"]["cached"] >= n - 1  # the next turn resumes the stored turn
    if spec.expect == "cached":  # any block boundary
        assert r["branched"]["cached"] == harness.BRANCH
    if spec.expect == "exact":  # state layers: no stride checkpoint in 96 tokens at the default
        assert r["branched"]["cached"] == 0  # step; the first branch leaves its branch point,
        assert r["branched_again"]["cached"] == harness.BRANCH  # the next one resumes there
    if "image_b" in r:  # another image never shares a block that holds or follows it
        assert r["image_b"]["cached"] <= harness.IMAGE_AT
        assert r["warm"]["vision_cached"] or not spec.extra.get("encoder", True)


def test_a_new_process_hits_every_family(stores):
    """One process that never saw the prompts: a warm repeat of each family from its store."""
    missing = [n for n in SPECS if not (stores / n).exists()]
    for name in missing:  # run alone (-k): fill the store first
        harness.scenarios(SPECS[name], _uri(stores, name))
    code = (
        "import json, sys\n"
        "from test_families import SPECS, harness\n"
        "out = {n: harness.new_process(SPECS[n], sys.argv[1] + '/' + n) for n in SPECS}\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, f"file://{stores}"],
        capture_output=True,
        text=True,
        cwd=TESTS,
        env={"PYTHONPATH": f"{ROOT}:{TESTS}", "PATH": "/usr/bin:/bin"},
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, got in out.items():
        assert got["exact"], (name, got)
        expected = {"refused": 0, "repeat": got["positions"]}.get(
            SPECS[name].expect, got["positions"] - 1
        )
        assert got["cached"] == expected, (name, got)
