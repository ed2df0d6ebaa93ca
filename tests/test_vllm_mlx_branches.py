"""``mlxcache serve --engine vllm-mlx --continuous-batching`` on a hybrid model leaves a
checkpoint at a branch point (issue 26).

vllm-mlx's own ``Scheduler`` (tests/vllm_scheduler.py; each line a new scheduler, so a new
in-memory cache: another server but for the shared store). A document is stored by one request;
a second one that branches inside it (off the stride and off its chunk ends) resumes at the
stride checkpoint, ends one more chunk at the last block boundary before the branch and is
checkpointed there; a third one branching at the same place resumes there. Every answer is
mlx-lm's ``BatchGenerator`` (the one vllm-mlx drives) resumed at the same splits. Two requests
prefilled together get no extra split and leave no checkpoint there.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from test_integration_mlx_lm import build_folder
from test_serve_branches import BLOCK, STEP, WORDS, _ask
from test_serve_windows import ARCH, _common, _prompts, _stride
from vllm_servers import require_vllm_python


def test_a_branch_point_is_checkpointed_for_the_next_scheduler(tmp_path):
    folder = str(build_folder("qwen3_5", tmp_path / "qwen3_5", config=ARCH["qwen3_5"]))
    p0, p1, p2, p3, p4 = _prompts(
        folder, *(_ask(w) for w in (WORDS[120], "beside", "under", "over", "above"))
    )
    branch = _common(p0, p1)
    assert all(_common(a, b) == branch for a in (p0, p1, p2, p3) for b in (p2, p3, p4) if a != b)
    every = _stride(folder, STEP)
    hit, b = branch // every * every, branch // BLOCK * BLOCK
    assert 0 < hit < b and (b - hit) % STEP  # the branch point is none of the chunk ends
    steps = [
        [[p0], True],  # stored: chunks and checkpoints on the stride
        [[p3, p4], True],  # prefilled together: no extra split, nothing stored mid-prefill
        [[p1], True],  # alone: resumes at ``hit``, ends a chunk at ``b``, checkpointed there
        [[p2], True],  # resumes at ``b``
        {"prompt": p0, "splits": []},
        {"prompt": p1, "splits": [hit, b]},
        {"prompt": p2, "splits": [hit, b]},
    ]
    run = subprocess.run(
        [require_vllm_python(), str(Path(__file__).parent / "vllm_scheduler.py"), folder,
         f"file://{tmp_path}/cache", str(BLOCK), str(STEP)],
        input="".join(json.dumps(s) + "\n" for s in steps), capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [json.loads(x) for x in run.stdout.splitlines()]
    (first,), batched, (second,), (third,), *refs = lines
    want = [r[0][1] for r in refs]
    assert first == [0, want[0]]
    assert [cached for cached, _ in batched] == [hit, hit]
    assert second == [hit, want[1]]  # vllm-mlx resumed at ``hit`` and split at ``b``
    assert third == [b, want[2]]  # before branch points: ``hit``
    assert "branch point was not cut" not in run.stderr
