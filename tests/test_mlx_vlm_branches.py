"""Branch points of ``SharedAPCManager`` (mlx-vlm's checkpoint-mode APC on the shared store,
issue 26), in process.

mlx-vlm's self-check at model load says which models have state layers: only those look for
branch points (one ``longest``). A lookup that resumes before the end of the stored blocks
keeps the branch point; a prompt prefilled alone gets it as one more checkpoint length (rows
prefilled together get none: mlx-vlm would split every row there); its checkpoint goes to the
shared store only (mlx-vlm's in-process entries stay as they are) and another manager resumes
there with the logits of the engine split at the same places. Tiny real models, real arrays,
a real memory backend that counts its calls.
"""

from __future__ import annotations

import mlx.core as mx
import mlx_vlm
import pytest
from helpers import CountingBackend

from mlxcache import PrefixCache
from mlxcache.integrations.mlx_vlm import apc, chunk_stores
from mlxcache.integrations.mlx_vlm.apc import ImageDigests, SharedAPCManager
from mlxcache.tiny_models import build_tiny_vlm

BLOCK, STEP = 16, 32  # a stride of 32 on the tiny Qwen3.5 (test_serve_vlm_branches.py)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    folder = build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "qwen3_5", family="qwen3_5")
    return mlx_vlm.load(str(folder))[0]


@pytest.mark.parametrize(
    "family, mode, states", [("qwen3_5", "exact", True), ("gemma3", "exact", False),
                             ("qwen2_vl", "block", False)],
)  # fmt: skip
def test_only_models_with_state_layers_look_for_branch_points(family, mode, states, tmp_path):
    from mlx_vlm import apc as _apc

    folder = str(build_tiny_vlm(tmp_path / family, family=family))
    model = mlx_vlm.load(folder)[0]
    installed = apc.install(lambda path: PrefixCache(CountingBackend(), model=path))
    try:
        manager = _apc.from_env(folder)
        assert isinstance(manager, SharedAPCManager) and not manager.states
        _apc.self_check_model_apc(model, log=False)
        assert manager.checkpoint_mode == (mode == "exact") and manager.states == states
    finally:
        installed.uninstall()


def _manager(backend: CountingBackend, states: bool = True) -> SharedAPCManager:
    """A manager on ``backend`` (another server's, when another manager wrote it)."""
    manager = SharedAPCManager(
        PrefixCache(backend, model="qwen3_5-test", block_size=BLOCK), ImageDigests()
    )
    manager.states = states
    return manager


def _run(lm, cache: list, ids: list[int], start: int, cuts: list[int]) -> list:
    """The language model over ``ids[start:]`` in chunks of STEP from ``start``, also ending at
    each of ``cuts`` (mlx-vlm's prefill with those checkpoint lengths)."""
    s = start
    for cut in [*cuts, len(ids)]:
        for e in [*range(s + STEP, cut, STEP), cut]:
            lm(mx.array([ids[s:e]]), cache=cache)
            s = e
    mx.eval([c.state for c in cache])
    return cache


def _logits(lm, cache: list, suffix: list[int]) -> bytes:
    out = lm(mx.array([suffix]), cache=cache).logits
    return bytes(memoryview(out.astype(mx.float32)))


def test_a_branch_point_is_checkpointed_for_the_next_manager(qwen):
    lm = qwen.language_model
    ids = [int(t) for t in mx.random.randint(1, 200, (120,), key=mx.random.key(5)).tolist()]
    backend = CountingBackend()
    first = _manager(backend)
    cache = lm.make_cache()  # the first request, stored as our chunk stores and mlx-vlm do
    for e in range(STEP, 96 + 1, STEP):
        _run(lm, cache, ids[:e], e - STEP, [])
        first.store_prefill(ids[:e], cache, step=STEP)
    first.store_exact_cache(ids[:96], cache)
    # another server: a prompt that branches at 90 resumes at the stride checkpoint 64 and
    # finds its branch point 80, the last block boundary of the stored blocks it matches
    second, branch = _manager(backend), ids[:90] + [7, 8, 9, 10, 11, 12]
    restored, n = second.lookup_exact_cache(branch, min_prefix_tokens=0)
    assert n == 64 and second.branches.take(branch, 0) == 80
    assert second.branches.take(branch, 0) == 0  # taken once (by the prefill)
    second.lookup_exact_cache(branch, min_prefix_tokens=0)
    rows = [
        {"full_input_ids": branch, "prefix_len": 64, "extra_hash": 0, "checkpoint_lengths": [95]}
    ]
    two = [dict(rows[0]), {**rows[0], "full_input_ids": ids}]
    chunk_stores.add_branch_points(two, second)  # prefilled together: no extra split
    assert [r["checkpoint_lengths"] for r in two] == [[95], [95]]
    second.lookup_exact_cache(branch, min_prefix_tokens=0)
    chunk_stores.add_branch_points(rows, second)  # alone: mlx-vlm's prefill ends a chunk at 80
    assert rows[0]["checkpoint_lengths"] == [80, 95]
    _run(lm, restored, branch[:80], 64, [])
    entries = len(second._exact_cache)
    assert second.store_exact_cache(branch[:80], restored) is False  # the shared store only
    assert len(second._exact_cache) == entries and second.branches.stored == 1
    # a third request on another server branching there resumes at 80, as the engine split at
    # 64 and 80 (no branch point left for it)
    third, other = _manager(backend), ids[:90] + [13, 14, 15, 16, 17, 18]
    cache, n = third.lookup_exact_cache(other, min_prefix_tokens=0)
    assert n == 80 and third.branches.take(other, 0) == 0
    engine = _run(lm, lm.make_cache(), other[:80], 0, [64])
    assert _logits(lm, cache, other[80:]) == _logits(lm, engine, other[80:])
    # a branch at 58 (hit 32, branch point 48); without state layers the same lookup asks the
    # backend nothing more and finds no branch point
    calls, early = [], ids[:58] + [19, 20, 21, 22, 23, 24]
    for states in (True, False):
        fresh = _manager(backend, states)
        before = backend.calls["contains_many"]
        assert fresh.lookup_exact_cache(early, min_prefix_tokens=0)[1] == 32
        calls.append(backend.calls["contains_many"] - before)
        assert fresh.branches.take(early, 0) == (48 if states else 0)
    assert calls[0] == calls[1] + 1
