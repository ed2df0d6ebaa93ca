"""Run in the vllm-mlx venv: vllm-mlx's own ``Scheduler`` (text, continuous batching) on the
shared tier, fed from stdin. Usage: ``python vllm_scheduler.py FOLDER URI BLOCK [STEP]`` (the
prefill step: BLOCK unless given); each input line is ``[prompts, cached]``: prompts (token ids)
added together to a new scheduler (one batch), with its prefix cache (in memory, over the shared
tier) or, ``cached`` false, none; each output line is the ``[cached_tokens, output ids]`` of
each, greedy, 4 tokens. A line ``{"prompt": ids, "splits": [...]}`` is the reference instead:
mlx-lm's ``BatchGenerator`` (the one vllm-mlx drives) with segment ends at the splits, its
``[0, output ids]``."""

from __future__ import annotations

import itertools
import json
import sys

from mlx_lm import load

from mlxcache.integrations import vllm_mlx as seam

FOLDER, URI, BLOCK = sys.argv[1], sys.argv[2], int(sys.argv[3])
STEP = int(sys.argv[4]) if len(sys.argv) > 4 else BLOCK
seam.install(URI, block_size=BLOCK)
from vllm_mlx.request import Request, SamplingParams  # noqa: E402 - after install()
from vllm_mlx.scheduler import Scheduler, SchedulerConfig  # noqa: E402

MODEL, TOKENIZER = load(FOLDER)
IDS = itertools.count()


def run(prompts: list[list[int]], cached: bool) -> list[tuple[int, list[int]]]:
    """The cached tokens and answers of prompts added together to a new scheduler."""
    config = SchedulerConfig(prefill_step_size=STEP, enable_prefix_cache=cached)
    scheduler = Scheduler(MODEL, TOKENIZER, config)
    requests = []
    for p in prompts:
        params = SamplingParams(max_tokens=4, temperature=0.0)
        requests.append(Request(f"r{next(IDS)}", p, params, prompt_token_ids=list(p)))
        scheduler.add_request(requests[-1])
    done: set[str] = set()
    while len(done) < len(requests):
        done.update(scheduler.step().finished_request_ids)
    return [(r.cached_tokens, list(r.output_token_ids)) for r in requests]


def reference(prompt: list[int], splits: list[int]) -> list[tuple[int, list[int]]]:
    """mlx-lm's ``BatchGenerator`` alone on ``prompt``, greedy, segment ends at ``splits``."""
    from mlx_lm.generate import BatchGenerator

    cuts = [0, *splits, len(prompt)]
    gen = BatchGenerator(MODEL, prefill_step_size=STEP, max_tokens=4)
    gen.insert_segments([[prompt[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]], [4])
    out: list[int] = []
    while len(out) < 4:
        out += [r.token for r in gen.next_generated()]
    gen.close()
    return [(0, out)]


for line in sys.stdin:
    step = json.loads(line)
    out = reference(step["prompt"], step["splits"]) if isinstance(step, dict) else run(*step)
    print(json.dumps(out), flush=True)
