"""``mlxcache serve --engine vllm-mlx`` in vllm-mlx's default mode (no ``--continuous-batching``):
a conversation's next turn reuses its previous turn, from this server or from the shared store,
although vllm-mlx also holds a KV snapshot of its system prompt (issue 26).

With such a snapshot, vllm-mlx 0.6's streamed chat takes its prompt cache only when
``_peek_prefix_trie_tokens_saved`` says that cache saves more tokens than the snapshot; mlxcache's
cache (``simple_text.py``) answers that peek under its own keys (model identity and salt), in
memory and in the store, and reports the snapshot's tokens when the snapshot wins. Streamed,
as clients send them; every answer is vllm-mlx's own server's.
"""

from __future__ import annotations

import re
from functools import partial

from helpers import started_together
from vllm_servers import BLOCK, TEXT, Server, require_vllm_python, server_args

from mlxcache.tiny_models import build_tiny_lm

SYSTEM = {"role": "system", "content": TEXT}
TURNS = ("Tell me a story about a cat and the sea.", "What is the weather like tonight?")
OTHER = "Hello, how are you today?"  # another conversation: only the system prompt in common
HITS = re.compile(r"System KV cache HIT \(stream_chat\): reusing (\d+) tokens")


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def test_a_next_turn_beats_the_system_prompt_snapshot(tmp_path):
    python = require_vllm_python()
    # 16 layers, KV of 4 KB a token: one prompt's cache is over the 1 MB given to ``b``'s memory
    folder = str(build_tiny_lm(tmp_path / "lm", num_layers=16))
    cache = f"file://{tmp_path / 'cache'}"

    def start(name: str, uri: str | None, *extra: str) -> Server:
        args = [*server_args(python, folder, uri, uri is None), *extra]
        return Server(args, tmp_path / f"{name}.log", tmp_path / name)

    make = [partial(start, "stock", None), partial(start, "a", cache),
            partial(start, "b", cache, "--prefix-trie-cache-memory-mb", "1")]  # fmt: skip
    turn1, other = [SYSTEM, _user(TURNS[0])], [SYSTEM, _user(OTHER)]
    with started_together(make) as (stock, a, b):
        want1 = stock.chat(turn1, 8, stream=True)
        turn2 = [*turn1, {"role": "assistant", "content": want1[0]}, _user(TURNS[1])]
        want2 = stock.chat(turn2, 8, stream=True)
        want_other = stock.chat(other, 8, stream=True)
        # one server: turn 1, turn 2, another conversation (vllm-mlx snapshots the system prompt)
        one = [a.chat(m, 8, stream=True) for m in (turn1, turn2, other)]
        # two servers on one store, under a salt: ``b`` snapshots the system prompt, keeps no
        # prompt cache in memory (1 MB), and gets turn 2 of what ``a`` answered
        two = [b.chat(other, 8, salt="two", stream=True), a.chat(turn1, 8, salt="two", stream=True),
               b.chat(turn2, 8, salt="two", stream=True)]  # fmt: skip
        stock_hits = [int(n) for n in HITS.findall(stock.log())]
        logs = a.log() + b.log()
    assert [w[2] for w in (want1, want2, want_other)] == [None] * 3  # vllm-mlx reports none
    system = stock_hits[0]  # the snapshot's tokens: vllm-mlx's own log only
    assert stock_hits == [system, system] and 0 < system < want1[1]
    assert one[0] == (*want1[:2], 0)
    assert one[1][:2] == want2[:2]
    assert want1[1] <= one[1][2] < want2[1]  # turn 1's prompt and more, not the snapshot's
    assert one[2] == (*want_other[:2], system)  # the snapshot wins: its tokens are reported
    assert two[0] == (*want_other[:2], 0)
    assert two[1] == (*want1[:2], system // int(BLOCK) * int(BLOCK))  # the store's blocks
    assert two[2][:2] == want2[:2]
    assert want1[1] <= two[2][2] < want2[1]  # from the store, past ``b``'s own snapshot
    assert "mlx-lm prompt cache:" not in logs  # no failed lookup or store
