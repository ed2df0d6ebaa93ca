"""``mlxcache serve`` on a hybrid model leaves a checkpoint at a branch point (issue 26).

A document stored by one request, then a second one that branches inside it (off the stride):
it resumes at the stride checkpoint (or, after a system message, whose segment ends off the
blocks, at its end) and its prefill ends a chunk at the last block boundary
before the branch (one more segment end in mlx-lm's ``BatchGenerator``, or ``generate_step``'s
chunks stopped there when served alone), where its state is checkpointed; a third request on
another server that branches at the same place resumes there. Every answer (token ids and
log-probabilities, as the server returns them) is mlx-lm's engine resumed at the same splits,
computed here in-process: its ``BatchGenerator`` with the same segments, its ``stream_generate``
after the same chunk calls. The tiny mamba2 answers differently without the extra split, so
it shows. Models without state layers (dense, window-only) run exactly as mlx-lm's server does.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from test_integration_mlx_lm import build_folder
from test_serve import Server
from test_serve_windows import ARCH, CONFIGS, DOC, SYSTEM, _common, _prompts, _stride

BLOCK, STEP, MAX = 32, 64, 6  # a step of two blocks: a branch point at an odd block is new
WORDS = (DOC + DOC).split(" ")
AT = 120  # the word the documents differ at
QUESTION = "Question: what does the cache keep?"
FAMILIES = {
    "qwen3_5": ARCH["qwen3_5"],  # gated-delta and attention layers (ArraysCache + KVCache)
    # state layers only; its answers change at a split (so the extra one shows). Floats and an
    # ``expand`` that fits its heads, which transformers' config check (on load) asks for
    "mamba2": {**{k: v for k, v in CONFIGS["mamba2"].items() if k != "model_type"},
               "time_step_limit": [0.01, 10.0], "expand": 1},
}  # fmt: skip


def _ask(word: str) -> list[dict]:
    doc = " ".join([*WORDS[:AT], word, *WORDS[AT + 1 :]])
    return [{"role": "user", "content": doc + QUESTION}]


ASKS = [_ask(w) for w in (WORDS[AT], "beside", "under")]
# batched (mlx-lm's BatchGenerator); alone (a seed: its stream_generate) and batched after a
# system message (whose segment ends off the blocks and the stride), each under a salt of its
# own, so that only its own stores serve it
CASES = {
    "batched": ({}, ASKS),
    "alone": ({"seed": 7, "cache_salt": "alone"}, ASKS),
    "system": ({"cache_salt": "system"}, [[SYSTEM, *m] for m in ASKS]),
}


def _chat(server: Server, messages, **extra) -> tuple[list[tuple[int, float]], int]:
    """The answer's (token id, log-probability) pairs and the cached tokens of one request."""
    body = {"messages": messages, "max_tokens": MAX, "logprobs": True, **extra}
    out = server.post("/v1/chat/completions", body)
    steps = [(s["id"], s["logprob"]) for s in out["choices"][0]["logprobs"]["content"]]
    return steps, out["usage"]["prompt_tokens_details"]["cached_tokens"]


def _batched(model, prompt: list[int], splits: list[int]) -> list[tuple[int, float]]:
    """mlx-lm's ``BatchGenerator`` (greedy) on ``prompt`` with segment ends at ``splits``."""
    from mlx_lm.generate import BatchGenerator

    cuts = [0, *splits, len(prompt)]
    gen = BatchGenerator(model, prefill_step_size=STEP)
    gen.insert_segments([[prompt[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]], [MAX])
    out: list[tuple[int, float]] = []
    while len(out) < MAX:
        out += [(r.token, r.logprobs[r.token].item()) for r in gen.next_generated()]
    gen.close()
    return out


def _alone(model, tokenizer, prompt: list[int], splits: list[int]) -> list[tuple[int, float]]:
    """mlx-lm's ``stream_generate`` (greedy) after its own chunk calls up to each split."""
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    cache, start = make_prompt_cache(model), 0
    for cut in splits:
        for s in range(start, cut, STEP):  # generate_step's chunk calls
            model(mx.array(prompt[s : min(s + STEP, cut)])[None], cache=cache)
            mx.eval([c.state for c in cache])
        start = cut
    steps = stream_generate(
        model, tokenizer, prompt[start:], max_tokens=MAX, prompt_cache=cache,
        prefill_step_size=STEP,
    )  # fmt: skip
    return [(g.token, g.logprobs[g.token].item()) for g in steps]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_branch_inside_a_document_is_checkpointed_for_the_next_server(family, tmp_path):
    folder = str(build_folder(family, tmp_path / family, config=FAMILIES[family]))
    cache = f"file://{tmp_path}/cache"
    ours = ("--prefill-step-size", str(STEP), "--cache-block-size", str(BLOCK))
    with ThreadPoolExecutor(2) as pool:
        starting = [
            pool.submit(Server, folder, cache, tmp_path / f"ours{i}.log", *ours) for i in (1, 2)
        ]
    servers = [f.result() for f in starting if f.exception() is None]
    try:
        failed = [f.exception() for f in starting if f.exception() is not None]
        if failed:
            raise failed[0]
        first, second = servers
        got = {
            path: [
                _chat(first, asks[0], **extra),  # stored
                _chat(first, asks[1], **extra),  # branches inside the document
                _chat(second, asks[2], **extra),  # branches there too, on another server
            ]
            for path, (extra, asks) in CASES.items()
        }
        log = second.log()
    finally:
        for server in servers:
            server.kill()

    from mlx_lm import load

    model, tokenizer = load(folder)
    every = _stride(folder, STEP)
    system = _prompts(folder, [SYSTEM, {"role": "user", "content": ""}])[0]
    for path, (_, asks) in CASES.items():
        prompts = _prompts(folder, *asks)
        branch = _common(prompts[0], prompts[1])
        assert branch == _common(prompts[0], prompts[2]) == _common(prompts[1], prompts[2])
        b = branch // BLOCK * BLOCK  # the branch point
        if path == "system":  # mlx-lm's segment ends there: its chunks miss the stride
            hit = _common(system, prompts[0])
            assert all((k * every - hit) % STEP for k in range(1, branch // every + 1))
        else:
            hit = branch // every * every  # the stride checkpoint before it
        assert 0 < hit < b and (b - hit) % STEP  # not one of the first request's chunk ends
        cuts = [hit] if path == "system" else []  # the segment ends mlx-lm makes
        if path == "alone":
            want = [
                _alone(model, tokenizer, p, s)
                for p, s in zip(prompts, ([], [hit, b], [hit, b]), strict=True)
            ]
        else:
            want = [
                _batched(model, p, s)
                for p, s in zip(prompts, (cuts, [hit, b], [hit, b]), strict=True)
            ]
        answers, cached = zip(*got[path], strict=True)
        assert cached == (0, hit, b), path  # without branch points the third one: ``hit``
        for answer, reference in zip(answers, want, strict=True):
            assert len(answer) >= 1 and answer == reference[: len(answer)], path
        assert f"a shared-tier hit ({b} of {len(prompts[2])} tokens reused)" in log
        if family == "mamba2":  # without the split at b (the stock server resumed at ``hit``)
            run = _alone if path == "alone" else _batched
            args = (model, tokenizer) if path == "alone" else (model,)
            assert want[1] != run(*args, prompts[1], [hit]), path


KEY = ("tiny", None, None)


def _serve(generator: type, model, shared, prompt: list[int]):
    """One request as mlx-lm's server runs it batched: lookup, ``insert_segments``, prefill
    (an insert at each segment end it sees) and decode. Returns the positions of its chunk
    ends, of the segment ends it saw, and the answer."""
    cache, rest = shared.fetch_nearest_cache(KEY, prompt)
    have = len(prompt) - len(rest)
    gen = generator(model, prefill_step_size=STEP)
    gen.insert_segments([[rest]], [MAX], [cache], [prompt[:have]])
    ends, seen, out = [], [], []
    while len(out) < MAX:
        responses, generated = gen.next()
        for r in responses:
            ends.append(have + r.progress[0])
            if r.end_of_segment and not r.end_of_prompt:
                seen.append(ends[-1])
                ((layers, tokens),) = gen.extract_cache([r.uid]).values()
                shared.insert_cache(KEY, list(tokens), layers)
        out += [(r.token, r.logprobs[r.token].item()) for r in generated]
    gen.close()
    shared.flush()
    return ends, seen, out


def _ends(cuts: list[int]) -> list[int]:
    """mlx-lm's chunk ends for segments from ``cuts[0]`` ending at each later cut."""
    return [e for a, z in zip(cuts, cuts[1:], strict=False) for e in [*range(a + STEP, z, STEP), z]]


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_5"])
def test_only_state_layers_end_a_chunk_at_the_branch_point(family, tmp_path):
    """In-process, mlx-lm's ``BatchGenerator`` and ours on two copies of one store: a dense
    (llama) or window-only (gemma3_text) model runs a branched request exactly as mlx-lm does
    (the same chunks, segment ends and answer; no branch point asked for); a hybrid one
    (qwen3_5) adds one chunk end at the branch point, which the server never sees as a segment
    end."""
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    from mlxcache.backends.memory import MemoryBackend
    from mlxcache.integrations.mlx_lm import chunk_stores
    from mlxcache.integrations.mlx_lm.prompt_cache import SharedPromptCache

    config = FAMILIES.get(family, ARCH.get(family))
    folder = str(build_folder(family, tmp_path / family, config=config))
    model, _ = load(folder)
    prompts = _prompts(folder, *ASKS)

    class Asked(SharedPromptCache):
        """Counts the branch points asked for."""

        asked = 0

        def branch(self, tokens: list[int], have: int):
            self.asked += 1
            return super().branch(tokens, have)

    runs = []
    for ours in (False, True):
        backend = MemoryBackend()

        def shared(backend=backend):  # a server's prompt cache on the store (another server)
            return Asked(backend=backend, block_size=BLOCK, prefill_step=STEP, background=False)

        first = shared()
        cls = chunk_stores.batch_generator_class(BatchGenerator, first, lambda: KEY)
        _serve(cls, model, first, prompts[0])  # stored (the same with both classes)
        second = shared()
        cls = chunk_stores.batch_generator_class(BatchGenerator, second, lambda: KEY)
        run = _serve(cls if ours else BatchGenerator, model, second, prompts[1])
        runs.append((*run, second.asked, second.stats()["branch_points"]))
    (ends, seen, answer, _, _), (our_ends, our_seen, our_answer, asked, stored) = runs
    assert our_seen == seen == [len(prompts[1]) - 1]  # the server sees its own segment end only
    branch = _common(prompts[0], prompts[1])
    b = branch // BLOCK * BLOCK
    if family != "qwen3_5":
        assert (our_ends, our_answer, asked, stored) == (ends, answer, 0, 0)
        return
    n, hit = len(prompts[1]), branch // _stride(folder, STEP) * _stride(folder, STEP)
    assert ends == _ends([hit, n - 1, n]) and our_ends == _ends([hit, b, n - 1, n])
    assert (asked, stored) == (1, 1)  # one branch point asked for (a contains_many), stored
    assert our_answer == _batched(model, prompts[1], [hit, b])
