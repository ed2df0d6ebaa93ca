"""The agent workload (issue 26): a shared system prompt and a shared document, per family group.

Per family group (dense: glm; sliding window: olmo3, a 128-token window; chunked attention:
llama4, chunked at 128 tokens; recurrent: qwen3_5), tiny random-weight mlx-lm models of mlx-lm's
own test dimensions (``agents_engines.lm_config``: the server rows' models; each checked to make
its group's cache layers), greedy, through ``mlxcache.integrations.mlx_lm`` (``prefill`` +
``decode``) on a ``PrefixCache`` (``file://``, block ``block``):

- **chat**: ``conversations`` conversations share a ``system``-token system prompt, each with
  ``turns`` turns (a ``user``-token message, then the model's ``answer``-token reply, both kept
  in the next turn's prompt);
- **document**: ``questions`` questions after one shared ``document``-token passage inside the
  user turn.

Counted per request: the tokens it could reuse (the longest prefix it shares with an earlier
request's prompt and answer, all but its own last token) and the tokens reused

- by mlxcache in one worker;
- by mlxcache in two workers on the same store, conversations (questions) alternating
  between them, each with its own empty hot tier (another process or a restart sees the same);
- by mlx-lm's ``LRUPromptCache``, as mlx-lm's server uses it (the nearest cached prefix, then
  the prompt and answer inserted), in one worker and in two (one LRU each: nothing shared).

Bytes: all records stored over the block records alone (what a KV-only store of the same
tokens holds): the cost of tails and recurrent checkpoints. Counts, not times: no repeats.
"""

from __future__ import annotations

import copy
import uuid
from typing import Any

import numpy as np

from benchmarks import agents_engines, agents_shapes, agents_vlm
from benchmarks.common import Row, Stats, have

SECTION = "agents"
FULL = {"system": 1024, "document": 2048, "block": 256, "conversations": 8, "turns": 3,
        "questions": 8, "user": 64, "answer": 16}  # fmt: skip
SMOKE = {"system": 64, "document": 64, "block": 16, "conversations": 3, "turns": 2,
         "questions": 3, "user": 8, "answer": 4}  # fmt: skip


def _model(name: str) -> Any:
    import mlx.core as mx

    model = agents_engines.lm_model(agents_engines.lm_config(name))
    mx.eval(model.parameters())
    return model


def _ids(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(1, 990, size=n).tolist()  # below the tiny VLMs' image tokens


def _sessions(size: dict[str, int], kind: str) -> list[list[list[int]]]:
    """Each session's user messages in order (its first holds the shared part)."""
    rng = np.random.default_rng(7)
    if kind == "chat":
        shared = _ids(rng, size["system"])
        return [
            [shared + _ids(rng, size["user"])]
            + [_ids(rng, size["user"]) for _ in range(1, size["turns"])]
            for _ in range(size["conversations"])
        ]
    doc = _ids(rng, size["document"])
    return [[doc + _ids(rng, size["user"])] for _ in range(size["questions"])]


def shared_prefix(prompt: list[int], seen: list[list[int]]) -> int:
    """The reusable tokens of ``prompt``: its longest common prefix with a sequence computed
    before, all but its last token."""
    best = 0
    for s in seen:
        n = min(len(s), len(prompt) - 1)
        i = 0
        while i < n and s[i] == prompt[i]:
            i += 1
        best = max(best, i)
    return best


class _Worker:
    """One server: a PrefixCache on the shared store (mlxcache) or an LRUPromptCache (mlx-lm)."""

    def __init__(self, model: Any, uri: str | None, block: int, salt: str) -> None:
        from mlx_lm.models.cache import LRUPromptCache

        from mlxcache import PrefixCache

        self.model = model
        self.pc = (
            PrefixCache(uri, model="agents-bench", salt=salt, block_size=block, hot_bytes=0)
            if uri
            else None
        )
        self.lru = None if uri else LRUPromptCache(max_size=64)

    def ask(self, prompt: list[int], answer: int) -> tuple[int, list[int]]:
        """(tokens reused, the answer's tokens) of one greedy request."""
        import mlx.core as mx
        from mlx_lm.generate import generate_step
        from mlx_lm.models.cache import make_prompt_cache

        from mlxcache.integrations.mlx_lm import decode, prefill

        if self.pc is not None:
            state = prefill(self.model, prompt, cache=self.pc)
            out = list(decode(self.model, state, max_tokens=answer))
            return state.num_cached_tokens, out
        assert self.lru is not None
        cache, rest = self.lru.fetch_nearest_cache("agents-bench", prompt)
        reused = len(prompt) - len(rest) if cache is not None else 0
        if cache is None:
            cache, rest = make_prompt_cache(self.model), prompt
        greedy = lambda x: mx.argmax(x, axis=-1)  # noqa: E731
        steps = generate_step(mx.array(rest), self.model, prompt_cache=cache, sampler=greedy,
                              max_tokens=answer)  # fmt: skip
        out = [int(t) for t, _ in steps]
        # mlx-lm's server inserts the cache of the prompt and the answer but its last token
        self.lru.insert_cache("agents-bench", prompt + out[:-1], copy.deepcopy(cache))
        return reused, out

    def close(self) -> None:
        if self.pc is not None:
            self.pc.close()


def _workload(make: Any, size: dict[str, int], kind: str, workers: int) -> tuple[int, int]:
    """(tokens reused, tokens reusable) over the workload, sessions alternating over
    ``workers`` servers made by ``make()`` (each with ``ask`` and ``close``)."""
    pool = [make() for _ in range(workers)]
    sessions = _sessions(size, kind)
    history: list[list[int]] = [[] for _ in sessions]
    seen: list[list[int]] = []
    reused = reusable = 0
    try:
        for turn in range(max(len(s) for s in sessions)):
            for i, messages in enumerate(sessions):
                if turn >= len(messages):
                    continue
                prompt = history[i] + messages[turn]
                reusable += shared_prefix(prompt, seen)
                got, answer = pool[i % workers].ask(prompt, size["answer"])
                reused += got
                history[i] = prompt + answer
                seen.append(history[i])
    finally:
        for w in pool:
            w.close()
    return reused, reusable


def _bytes(uri: str, model: str, salt: str, block: int) -> tuple[int, int]:
    """(bytes of every record, bytes of the block records) this model and salt's store holds."""
    from mlxcache import PrefixCache

    with PrefixCache(uri, model=model, salt=salt, block_size=block) as pc:
        total = blocks = 0
        for key in pc.backend.keys(pc.key_prefix):
            h = pc.backend.header(key)
            if h is None:
                continue
            size = h.data_offset + h.data_size
            total += size
            blocks += size if key[len(pc.key_prefix) :].startswith("b/") else 0
    return total, blocks


def _servers(model: Any, uri: str, block: int, salt: str) -> list[tuple[str, Any, int]]:
    """(who, a maker of one server, how many servers) of each side of the comparison."""
    return [
        ("mlxcache, one worker", lambda: _Worker(model, uri, block, salt), 1),
        ("mlxcache, two workers", lambda: _Worker(model, uri, block, salt + "-2"), 2),
        ("mlx-lm LRUPromptCache, one worker", lambda: _Worker(model, None, block, ""), 1),
        ("mlx-lm LRUPromptCache, two workers", lambda: _Worker(model, None, block, ""), 2),
    ]


def _count_row(group: str, name: str, kind: str, who: str, reused: int, reusable: int,
               note: str = "", layers: list[str] | None = None) -> Row:  # fmt: skip
    share = reused / reusable if reusable else None
    return Row(
        SECTION,
        f"{group} ({name}), {kind}: {who}",
        reusable,
        None,
        "tokens",
        Stats.of([float(reused)]),
        ratio=share,
        ratio_kind="tokens reused / reusable",
        note=note,
        extra={} if layers is None else {"cache_layers": layers},
    )


def run(ctx: Any) -> list[Row]:
    if not have("mlx_lm") or not agents_engines.CONFIGS.exists():
        ctx.note("mlx-lm or tests/families/mlx_lm_configs.json is missing: agents rows left out.")
        return []
    size = SMOKE if ctx.smoke else FULL
    rows: list[Row] = []
    for group, name in agents_engines.LM_GROUPS.items():
        model = _model(name)
        layers = agents_engines.cache_layers(group, model)
        for kind in ("chat", "document"):
            uri = f"file://{ctx.tmpdir / 'agents'}"
            salt = uuid.uuid4().hex
            block = size["block"]
            for who, make, workers in _servers(model, uri, block, salt):
                got = _workload(make, size, kind, workers)
                rows.append(_count_row(group, name, kind, who, *got, layers=layers))
            total, blocks = _bytes(uri, "agents-bench", salt, block)
            rows.append(
                Row(
                    SECTION,
                    f"{group} ({name}), {kind}: bytes stored over the block records alone",
                    None,
                    total,
                    "ratio",
                    Stats.of([total / blocks if blocks else 0.0]),
                    note=f"{total} bytes in all, {blocks} in block records (tiny shapes)",
                )
            )
    rows += agents_shapes.run(size, ctx, _workload, _bytes)
    if have("mlx_vlm.apc") and have("mlxcache.integrations.mlx_vlm"):
        rows += agents_vlm.run(size, ctx, _workload, _count_row)
    else:
        ctx.note("mlx-vlm's APC or mlxcache's mlx-vlm integration is missing: its rows left out.")
    ctx.note(
        f"agents: block {size['block']}, {size['conversations']} conversations x "
        f"{size['turns']} turns on a {size['system']}-token system prompt, {size['questions']} "
        f"questions after a {size['document']}-token document; reusable = the longest prefix "
        "shared with an earlier prompt and answer, all but the last token. Bytes against the "
        "1.25x target: the rows on real models' shapes (benchmarks/agents_shapes.py)."
    )
    return rows
