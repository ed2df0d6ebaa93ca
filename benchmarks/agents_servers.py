"""The agent workload (benchmarks/agents.py) over real HTTP: each engine's stock server against
``mlxcache serve``, one server and two servers, per family group (issue 26).

Scaled down for servers (``FULL``): block 32, a 256-token system prompt shared by 8
conversations of 3 turns (32-token user messages, 8-token answers kept in the next turn), and
8 questions after one 512-token document inside the user turn; every server prefills in steps of
one block (benchmarks/agents_engines.py). Per engine and family, five servers start together:
the stock server alone, two stock servers (requests of one conversation, or question, go to
server ``i % 2``), and two of ours on one ``file://`` store (alone: the first, under a salt of
its own; two: both, under another salt).

Counted per request: the tokens reusable (the longest prefix the prompt shares with an earlier
prompt followed by its answer, as the server tokenizes them; all but the last token) and the
server's ``usage.prompt_tokens_details.cached_tokens`` (stock vllm-mlx reports none: the change
of ``tokens_saved`` in its ``GET /v1/cache/stats``, plus, in its default mode, the tokens of its
system-prompt KV snapshots, which only its log names; ours counts those in ``cached_tokens``).
Greedy answers of ours are compared with the stock server's, request by request (one server with
one, two with two). ``run(ctx, engines)`` runs only the engines whose name holds one of
``engines`` (``python -m benchmarks --only agents_servers --engines "default mode"``).
"""

from __future__ import annotations

import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import agents_engines
from benchmarks.agents import shared_prefix
from benchmarks.agents_engines import Engine, HttpServer
from benchmarks.common import Row, Stats, have

SECTION = "agents_servers"
FULL = {"system": 256, "document": 512, "block": 32, "conversations": 8, "turns": 3,
        "questions": 8, "user": 32, "answer": 8}  # fmt: skip
SMOKE = {"system": 96, "document": 192, "block": 32, "conversations": 3, "turns": 2,
         "questions": 3, "user": 16, "answer": 4}  # fmt: skip
WORDS = (
    "the cache keeps what model has already computed so a repeated prompt skips its prefill is "
    "split into blocks of tokens each block named by hash every token before two servers that "
    "share store find other and restarted server own"
).split()
STOCK = {"mlx-lm": "mlx_lm.server", "mlx-vlm": "mlx_vlm.server APC"}


def _text(rng: np.random.Generator, tokens: Any, n: int) -> str:
    """Random words from the tiny tokenizers' text, at least ``n`` tokens long."""
    words: list[str] = []
    while len(tokens.encode(" ".join(words))) < n:
        words += rng.choice(WORDS, size=max(1, (n - len(words)) // 2)).tolist()
    return " ".join(words)


def _sessions(tokens: Any, size: dict[str, int], kind: str) -> list[list[list[dict[str, str]]]]:
    """Each session's new messages turn by turn (its first turn holds the shared part)."""
    rng = np.random.default_rng(7 if kind == "chat" else 8)

    def user(n: int, before: str = "") -> list[dict[str, str]]:
        return [{"role": "user", "content": before + _text(rng, tokens, n)}]

    if kind == "chat":
        system = {"role": "system", "content": _text(rng, tokens, size["system"])}
        return [
            [[system, *user(size["user"])]] + [user(size["user"]) for _ in range(1, size["turns"])]
            for _ in range(size["conversations"])
        ]
    doc = _text(rng, tokens, size["document"])
    return [[user(size["user"], f"{doc}\nQuestion: ")] for _ in range(size["questions"])]


class Side:
    """The servers of one column: stock or ours, one or two, and what they have seen."""

    def __init__(self, servers: list[HttpServer], salt: str | None, engine: Engine,
                 stock: bool) -> None:  # fmt: skip
        self.servers, self.salt, self.stock = servers, salt, stock
        self.vllm, self.stream = engine.vllm, engine.stream
        self.seen: list[list[int]] = []  # over both workloads: the servers keep their caches
        # tokens of vllm-mlx's system-prompt snapshot hits, as its log names them: stock, those
        # it restores; ours, those it found (it may restore the longer prompt cache instead)
        self.snapshot = 0

    def ask(self, i: int, messages: list[dict[str, str]], answer: int) -> tuple[str, int, int]:
        """(answer, prompt tokens, tokens reused) of request ``i`` (server ``i % n``)."""
        server = self.servers[i % len(self.servers)]
        before = server.saved() if self.vllm and self.stock else 0
        if self.vllm:
            server.system_hits()  # what came before this request
        text, n, cached = server.chat(messages, answer, self.salt, self.stream)
        if self.vllm and self.stock:  # vllm-mlx reports none: its stats' tokens_saved
            cached = server.saved() - before
        if self.vllm:  # vllm-mlx's system-prompt snapshots (default mode)
            snapshot = server.system_hits()
            self.snapshot += snapshot
            if self.stock:  # in no usage of the stock server; ours counts them in cached_tokens
                cached = (cached or 0) + snapshot
        return text, n, int(cached or 0)

    def workload(self, tokens: Any, sessions: list[list[list[dict[str, str]]]],
                 answer: int) -> dict[str, Any]:  # fmt: skip
        """Turn by turn over every session: reused and reusable tokens, the answers."""
        history: list[list[dict[str, str]]] = [[] for _ in sessions]
        out: dict[str, Any] = {"reused": 0, "reusable": 0, "answers": [], "mismatch": 0}
        self.snapshot = 0
        for turn in range(max(len(s) for s in sessions)):
            for i, turns in enumerate(sessions):
                if turn >= len(turns):
                    continue
                prompt = history[i] + turns[turn]
                ids = tokens.prompt(prompt)
                text, n, reused = self.ask(i, prompt, answer)
                out["reusable"] += shared_prefix(ids, self.seen)
                out["reused"] += reused
                out["mismatch"] += n != len(ids)
                out["answers"].append(text)
                history[i] = [*prompt, {"role": "assistant", "content": text}]
                self.seen.append(ids + tokens.encode(text))
        out["snapshot"] = self.snapshot
        return out


def _start(engine: Engine, folder: str, uri: str, block: int, where: Path) -> list[HttpServer]:
    """Stock alone, two stock, two of ours on ``uri``: started at once, each with its own log."""
    specs = []
    for name, side in (("stock1", "one"), ("stock2a", "two"), ("stock2b", "two")):
        home = where / f"home-{side}"  # vllm-mlx's disk cache and APC's disk tier: per side
        specs.append((engine.stock(folder, block), where / f"{name}.log", home,
                      engine.stock_env(home), engine.model(folder)))  # fmt: skip
    for name in ("ours_a", "ours_b"):
        specs.append((engine.ours(folder, uri, block), where / f"{name}.log", where / name, {},
                      engine.model(folder)))  # fmt: skip
    with ThreadPoolExecutor(len(specs)) as pool:
        starting = [pool.submit(HttpServer, *s) for s in specs]
    servers = [f.result() for f in starting if f.exception() is None]
    failed = [f.exception() for f in starting if f.exception() is not None]
    if failed:
        for s in servers:
            s.kill()
        raise failed[0]  # type: ignore[misc]
    return servers


def _row(engine: str, group: str, family: str, kind: str, who: str, got: dict[str, Any],
         note: str, **extra: Any) -> Row:  # fmt: skip
    reusable = got["reusable"]
    return Row(
        SECTION,
        f"{engine}, {group} ({family}), {kind}: {who}",
        reusable,
        None,
        "tokens",
        Stats.of([float(got["reused"])]),
        ratio=got["reused"] / reusable if reusable else None,
        ratio_kind="tokens reused / reusable",
        note=note,
        extra={
            "requests": len(got["answers"]),
            "prompt_mismatch": got["mismatch"],
            "system_snapshot_tokens": got["snapshot"],
            **extra,
        },  # fmt: skip
    )


def _family(engine: Engine, group: str, family: str, size: dict[str, int], ctx: Any) -> list[Row]:
    where = ctx.tmpdir / "agents-servers" / engine.name.replace(" ", "_") / family
    where.mkdir(parents=True, exist_ok=True)
    folder = engine.folder(family, where / "model")
    tokens = engine.tokens(folder)
    servers = _start(engine, str(folder), f"file://{where / 'store'}", size["block"], where)
    stock_name = STOCK.get(engine.name, "vllm-mlx serve")
    rows = []
    try:
        run = uuid.uuid4().hex[:8]
        sides = {
            f"{stock_name}, one server": Side(servers[:1], None, engine, True),
            f"{stock_name}, two servers": Side(servers[1:3], None, engine, True),
            "mlxcache serve, one server": Side(servers[3:4], f"one-{run}", engine, False),
            "mlxcache serve, two servers": Side(servers[3:5], f"two-{run}", engine, False),
        }
        for kind in ("chat", "document"):
            sessions = _sessions(tokens, size, kind)
            got = {w: side.workload(tokens, sessions, size["answer"]) for w, side in sides.items()}
            for who, result in got.items():
                note, extra = "", {}
                if who.startswith("mlxcache"):
                    n = who.split(", ")[1]
                    want = got[f"{stock_name}, {n}"]["answers"]
                    equal = sum(a == b for a, b in zip(result["answers"], want, strict=True))
                    note = f"{equal} of {len(want)} answers equal to the stock server's"
                    extra = {"equal_answers": equal}
                rows.append(_row(engine.name, group, family, kind, who, result, note, **extra))
    finally:
        for s in servers:
            s.kill()
    return rows


def run(ctx: Any, engines: list[str] | None = None) -> list[Row]:
    if not have("mlx_lm") or not have("mlx_vlm") or not agents_engines.CONFIGS.exists():
        ctx.note("mlx-lm, mlx-vlm or tests/families/mlx_lm_configs.json is missing: the agent "
                 "workload's server rows are left out.")  # fmt: skip
        return []
    size = SMOKE if ctx.smoke else FULL
    vllm = not ctx.smoke and Path(agents_engines.VLLM_PYTHON).exists()
    if not ctx.smoke and not vllm:
        ctx.note(f"no vllm-mlx venv at {agents_engines.VLLM_PYTHON}: its agent rows left out.")
    rows: list[Row] = []
    chosen = [
        e for e in agents_engines.engines(vllm) if not engines or any(n in e.name for n in engines)
    ]
    for engine in chosen:
        groups = {"sliding": engine.groups["sliding"]} if ctx.smoke else engine.groups
        if ctx.smoke and engine.name != "mlx-lm":
            continue
        for group, family in groups.items():
            if group in engine.unserved:
                ctx.note(f"agents_servers: {engine.name} does not serve {family} ({group}): "
                         f"{engine.unserved[group]}.")  # fmt: skip
                continue
            t0 = time.perf_counter()
            try:
                rows += _family(engine, group, family, size, ctx)
            except Exception as e:  # one engine's failure must not lose the others' rows
                what = f"{engine.name} on {family}"
                ctx.note(f"agents_servers: {what} failed: {type(e).__name__}: {e}")
            print(f"[agents_servers: {engine.name} {family}: {time.perf_counter() - t0:.0f} s]",
                  file=sys.stderr)  # fmt: skip
    ctx.note(
        f"agents_servers: block {size['block']} (prefill steps of one block), "
        f"{size['conversations']} conversations x {size['turns']} turns on a "
        f"{size['system']}-token system prompt, {size['questions']} questions after a "
        f"{size['document']}-token document; reused = usage.prompt_tokens_details.cached_tokens "
        "(stock vllm-mlx: the change of its tokens_saved)."
    )
    return rows
