"""``mlxcache serve --engine vllm-mlx --continuous-batching`` on sliding-window and hybrid
models: a document shared inside the user turn is reused by a second server (issue 26).

vllm-mlx stores a request's cache when it finishes, after its window layers dropped the
document's blocks and with its state layers at that one length; mlxcache also stores after each
of the scheduler's prefill chunks (``chunk_stores.py``). Prefill steps of one block keep vllm-mlx's
own splits on every hit, so each answer must be vllm-mlx's own server's, caches off.
"""

from __future__ import annotations

import json
import re
import subprocess
from functools import partial
from pathlib import Path

import pytest
from helpers import started_together
from test_integration_mlx_lm import build_folder
from test_serve_windows import ARCH, ASK, BLOCK, CONFIGS, DOC, SYSTEM, _common, _prompts, _stride
from vllm_servers import Server, require_vllm_python, server_args

OPTIONS = ("--continuous-batching", "--prefill-step-size", str(BLOCK))


def _schedule(folder: str, tmp_path, steps: list) -> subprocess.CompletedProcess:
    """vllm-mlx's own Scheduler on ``folder`` with mlxcache's shared tier on a file:// store,
    fed ``steps`` (tests/vllm_scheduler.py): its output lines, one JSON list per step."""
    run = subprocess.run(
        [require_vllm_python(), str(Path(__file__).parent / "vllm_scheduler.py"), folder,
         f"file://{tmp_path}/cache", str(BLOCK)],
        input="".join(json.dumps(s) + "\n" for s in steps), capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def _start(python: str, folder: str, cache: str | None, log, home, options=OPTIONS) -> Server:
    args = server_args(python, folder, cache, cache is None)
    if cache is not None:  # our blocks: BLOCK tokens, the prefill step
        i = args.index("--cache-block-size")
        args[i + 1] = str(BLOCK)
    return Server([*args, *options], log, home)


def _three_servers(python: str, folder: str, tmp_path, options=OPTIONS) -> list:
    """Starters for ``started_together``: vllm-mlx as shipped (caches off), then two of ours
    on one ``file://`` store."""
    cache = f"file://{tmp_path}/cache"
    return [
        partial(_start, python, folder, c, tmp_path / f"{name}.log", tmp_path / name, options)
        for name, c in (("stock", None), ("first", cache), ("second", cache))
    ]


@pytest.mark.parametrize("family", sorted(ARCH))
def test_a_shared_document_hits_on_a_second_server(family, tmp_path):
    python = require_vllm_python()
    folder = str(build_folder(family, tmp_path / family, config=ARCH[family]))
    make = _three_servers(python, folder, tmp_path)
    with started_together(make) as (stock, first, second):
        want = [stock.chat(m, 6) for m in ASK]
        cold = [first.chat(ASK[0], 6), first.chat(ASK[0], 6, salt="alice")]
        warm = second.chat(ASK[1], 6)  # another process: the first one's chunks
        again = second.chat(ASK[0], 6)  # the first prompt again: all but its last token
        salted = [second.chat(ASK[1], 6, salt=s) for s in ("alice", "bob")]
        stats = second.get("/v1/cache/stats")["engine_cache"]["mlxcache"]
    assert all(w[2] is None for w in want)  # vllm-mlx as shipped, caches off
    ids = _prompts(folder, *ASK)
    assert [w[1] for w in want] == [len(p) for p in ids]  # the same chat template
    hit = _common(*ids) // BLOCK * BLOCK
    assert hit >= 3 * BLOCK  # the document spans blocks past the window
    if family == "qwen3_5":  # state checkpoints: at chunk ends on the stride only
        every = _stride(folder)
        hit = hit // every * every
        assert hit >= every
    assert cold == [(*want[0][:2], 0)] * 2
    assert warm == (*want[1][:2], hit)  # vllm-mlx's own answer, resumed on its own splits
    assert again == (*want[0][:2], want[0][1] - 1)
    assert salted == [(*want[1][:2], hit), (*want[1][:2], 0)]  # each salt's own chunks
    assert stats["lookup_errors"] == stats["store_errors"] == 0


def test_prompts_prefilled_together_store_no_chunks(tmp_path):
    """vllm-mlx 0.6's batched prefill of a hybrid model (two prompts in one prompt batch)
    answers differently from one prompt's; its chunks are not stored, so a prompt that later
    runs alone never resumes from them. Alone, the same prompts store and hit (vllm-mlx's own
    ``Scheduler``, requests added before its first step: deterministically one batch)."""
    folder = str(build_folder("qwen3_5", tmp_path / "qwen3_5", config=ARCH["qwen3_5"]))
    other = [{"role": "user", "content": ASK[0][0]["content"] * 2}]
    p0, p1, p2 = _prompts(folder, *ASK, other)
    steps = [[[p0], False], [[p1], False], [[p0, p2], True], [[p1], True], [[p0], True],
             [[p1], True]]  # fmt: skip
    run = _schedule(folder, tmp_path, steps)
    lines = [json.loads(x) for x in run.stdout.splitlines()]
    (want0,), (want1,), batched, (alone,), (again,), (repeat,) = lines
    assert want0[0] == want1[0] == 0  # vllm-mlx's own answers, caches off
    assert [cached for cached, _ in batched] == [0, 0]
    assert batched[0][1] != want0[1]  # vllm-mlx 0.6: p0 prefilled with p2 answers otherwise
    hit = _common(p0, p1) // _stride(folder) * _stride(folder)
    assert hit >= BLOCK
    assert alone == [0, want1[1]]  # nothing of the batch's document (its chunks: a hit)
    assert again == [hit, want0[1]]  # p1's chunks, stored when it ran alone
    assert repeat == [len(p1) - 1, want1[1]]  # p1 again: all but its last token


def test_a_window_document_stored_by_a_batch_is_completed_by_a_prompt_alone(tmp_path):
    """gemma3_text (window of 16 tokens): two prompts prefilled together store no chunks, so
    the finished requests' stores write the document's blocks without the window's part
    (dropped by then; marked). A prompt sharing the document alone then misses, but its chunk
    stores complete those blocks, and a third one resumes at the document's last block
    boundary, answering as vllm-mlx with caches off."""
    folder = str(build_folder("gemma3_text", tmp_path / "gemma3_text"))
    other = [{"role": "user", "content": ASK[0][0]["content"] * 2}]
    third = [{"role": "user", "content": DOC + "Question: what is a block named by?"}]
    p0, p1, p2, p3 = _prompts(folder, *ASK, other, third)
    steps = [[[p3], False], [[p0, p2], True], [[p1], True], [[p3], True]]
    run = _schedule(folder, tmp_path, steps)
    (want,), batched, (alone,), (third_,) = [json.loads(x) for x in run.stdout.splitlines()]
    assert want[0] == 0 and [cached for cached, _ in batched] == [0, 0]
    assert alone[0] == 0  # the document's blocks lack the window's part
    hit = min(_common(p0, p3), _common(p1, p3)) // BLOCK * BLOCK
    assert hit >= 3 * BLOCK  # past the window
    assert third_ == [hit, want[1]]


def test_default_mode_stores_the_prefill_chunks_of_a_hybrid(tmp_path):
    """vllm-mlx's default mode (no ``--continuous-batching``) prefills in mlx-lm's default step
    of 2,048 tokens, which no option changes; the state checkpoint at its first chunk end lets
    another server resume a long shared document there, on vllm-mlx's own splits."""
    python = require_vllm_python()
    folder = str(build_folder("qwen3_5", tmp_path / "qwen3_5", config=ARCH["qwen3_5"]))
    ask = [[{"role": "user", "content": DOC * 17 + m[0]["content"][len(DOC) :]}] for m in ASK]

    make = _three_servers(python, folder, tmp_path, options=())  # the default mode
    with started_together(make) as (stock, first, second):
        want = [stock.chat(m, 6) for m in ask]
        cold = [first.chat(ask[0], 6), first.chat(ask[0], 6, salt="alice")]
        warm = [second.chat(ask[1], 6, salt=s) for s in (None, "alice", "bob")]
        logs = first.log() + second.log()
    assert all(w[2] is None for w in want)  # vllm-mlx as shipped, caches off
    ids = _prompts(folder, *ask)
    assert [w[1] for w in want] == [len(p) for p in ids]
    assert _common(*ids) > 2048 == _stride(folder, 2048)
    assert [c[:2] for c in cold] == [want[0][:2]] * 2
    assert warm == [(*want[1][:2], 2048), (*want[1][:2], 2048), (*want[1][:2], 0)]
    assert "mlx-lm prompt cache:" not in logs  # no failed lookup, store or snapshot


SNAPSHOT = re.compile(r"System KV cache (HIT|MISS|STORED)")
WINDOWS = {  # RotatingKVCache and KVCache layers: windows of 16, 32 and 128 tokens
    "gemma3_text": None,
    "gpt_oss": {k: v for k, v in CONFIGS["gpt_oss"].items() if k != "model_type"},  # + sinks
    "olmo3": {k: v for k, v in CONFIGS["olmo3"].items() if k != "model_type"},
}


@pytest.mark.parametrize("family", sorted(WINDOWS))
def test_default_mode_window_model_on_the_prompt_cache_without_snapshots(family, tmp_path):
    """vllm-mlx's default mode keeps window models (``RotatingKVCache`` layers) off its
    cache-aware branch (``non_kv_cache_class``); under mlxcache (``window_models.py``) they take
    that branch with mlxcache's prompt cache: a repeat and a second server (a shared document,
    another question) resume at a block boundary and answer as vllm-mlx's own server, while
    vllm-mlx's system-prompt KV snapshots stay off for them, also for a request with a system
    message."""
    python = require_vllm_python()
    folder = str(build_folder(family, tmp_path / family, config=WINDOWS[family]))
    system = [SYSTEM, *ASK[0]]

    make = _three_servers(python, folder, tmp_path, options=())  # the default mode
    with started_together(make) as (stock, first, second):
        want = [stock.chat(m, 6) for m in (*ASK, system)]
        streamed = stock.chat(ASK[0], 6, stream=True)  # vllm-mlx strips leading blanks unstreamed
        one = [first.chat(ASK[0], 6), first.chat(ASK[0], 6, stream=True)]
        two = second.chat(ASK[1], 6)  # another process: the first one's blocks
        sys_ = [first.chat(system, 6), second.chat(system, 6)]
        stock_log, logs = stock.log(), first.log() + second.log()
    assert all(w[2] is None for w in (*want, streamed))  # vllm-mlx as shipped, caches off
    off = "System KV cache snapshot disabled (stream_chat)"  # vllm-mlx's probe: uncached path
    assert off in stock_log
    ids = _prompts(folder, *ASK, system)
    assert [w[1] for w in want] == [len(p) for p in ids]  # the same chat template
    hit = _common(ids[0], ids[1]) // BLOCK * BLOCK
    assert hit >= 3 * BLOCK  # the document spans blocks (past gemma3_text's window)
    assert one[0] == (*want[0][:2], 0)
    last = [(len(p) - 1) // BLOCK * BLOCK for p in ids]  # the last block boundary before the end
    assert one[1] == (*streamed[:2], last[0])  # the repeat, streamed: from the cache
    assert two == (*want[1][:2], hit)  # vllm-mlx's own answer, resumed at a block boundary
    # the system message's request: on the prompt cache (first's blocks), no snapshot
    assert sys_ == [(*want[2][:2], 0), (*want[2][:2], last[2])]
    assert "non_kv_cache_class" not in logs
    assert not SNAPSHOT.findall(logs)  # vllm-mlx never snapshots this model's cache
    assert "mlx-lm prompt cache:" not in logs  # no failed lookup or store
