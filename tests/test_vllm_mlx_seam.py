"""The parts of the vllm-mlx seam that need no vllm-mlx: the prompt count that carries cached
tokens, the version range."""

from __future__ import annotations

import os
import subprocess
import sys

from mlxcache.integrations.vllm_mlx.usage import PromptCount


def test_prompt_count_is_its_number_and_carries_cached_tokens():
    n = PromptCount(300, 299)
    assert n == 300 and n + 1 == 301 and isinstance(n, int)
    assert n.cached_tokens == 299
    assert PromptCount(5, 9).cached_tokens == 5  # never more than the prompt
    assert PromptCount(5, -1).cached_tokens == 0


def test_a_sum_of_counts_sums_their_cached_tokens():
    total = 0
    for n in (PromptCount(10, 4), PromptCount(20, 19), 7):
        total += n
    assert total == 37 and total.cached_tokens == 23


def test_a_version_outside_the_tested_range_is_one_line_before_any_model(tmp_path):
    """An installed vllm-mlx 0.7.1 (its distribution metadata first on the path): one line."""
    info = tmp_path / "vllm_mlx-0.7.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-mlx\nVersion: 0.7.1\n")
    run = subprocess.run(
        [sys.executable, "-m", "mlxcache", "serve", "--engine", "vllm-mlx", "--model", "m"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.getcwd()])),
    )
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "vllm-mlx 0.7.1 is outside the tested range" in lines[0], run.stderr
