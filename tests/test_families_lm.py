"""The mlx-lm side of the model-family matrix (docs/models.md): mlx-lm's answer, bit for bit.

One tiny model per family (configs from mlx-lm's own ``test_all_models``, gpt_oss's from its
``test_gpt_oss`` at the others' tiny width), prompts cold, warm, extended and branched (twice)
through mlxcache on a ``file://`` store, each compared with mlx-lm's uncached ``generate_step`` (or
mlx-lm resumed at the same splits, for recurrent layers: a cold run splits where mlx-lm does).
"""

from __future__ import annotations

import pytest

pytest.importorskip("mlx_lm")

from families import lm  # noqa: E402
from families.harness import BRANCH, PROMPT  # noqa: E402

# family -> what a branched prompt reuses: "block" (any block boundary), "checkpoint" (recurrent
# layers: a stride checkpoint, here none below 2,048 tokens, or the branch point a request that
# branched there left, docs/prefix.md "Checkpoints")
FAMILIES = {
    "glm": "block",
    "seed_oss": "block",
    "ernie4_5_moe": "block",
    "glm4_moe_lite": "block",
    "llama4_text": "block",
    "qwen3_vl": "block",
    "exaone4": "block",
    "olmo3": "block",
    "gpt_oss": "block",
    "gemma4": "block",
    "llama4": "block",
    "mamba2": "checkpoint",
    "qwen3_5": "checkpoint",
    "qwen3_5_moe": "checkpoint",
    "qwen3_next": "checkpoint",
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_text_family_answers_like_mlx_lm(name, tmp_path):
    r = lm.scenarios(name, f"file://{tmp_path}")
    for case, got in r.items():
        assert got["exact"], (case, got)  # never a different answer
    assert r["cold"]["cached"] == 0 and r["warm"]["cached"] == PROMPT - 1
    assert r["extended"]["cached"] >= PROMPT - 1  # the next turn resumes the stored turn
    branched = BRANCH if FAMILIES[name] == "block" else 0
    assert r["branched"]["cached"] == branched
    assert r["branched_again"]["cached"] == BRANCH
