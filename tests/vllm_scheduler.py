"""Run in the vllm-mlx venv: vllm-mlx's own ``Scheduler`` (text, continuous batching) on the
shared tier, fed from stdin. Usage: ``python vllm_scheduler.py FOLDER URI BLOCK``; each input
line is ``[prompts, cached]``: prompts (token ids) added together to a new scheduler (one
batch), with its prefix cache (in memory, over the shared tier) or, ``cached`` false, none; each
output line is the ``[cached_tokens, output ids]`` of each, greedy, 4 tokens."""

from __future__ import annotations

import itertools
import json
import sys

from mlx_lm import load

from mlxcache.integrations import vllm_mlx as seam

FOLDER, URI, BLOCK = sys.argv[1], sys.argv[2], int(sys.argv[3])
seam.install(URI, block_size=BLOCK)
from vllm_mlx.request import Request, SamplingParams  # noqa: E402 - after install()
from vllm_mlx.scheduler import Scheduler, SchedulerConfig  # noqa: E402

MODEL, TOKENIZER = load(FOLDER)
IDS = itertools.count()


def run(prompts: list[list[int]], cached: bool) -> list[tuple[int, list[int]]]:
    """The cached tokens and answers of prompts added together to a new scheduler."""
    config = SchedulerConfig(prefill_step_size=BLOCK, enable_prefix_cache=cached)
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


for line in sys.stdin:
    print(json.dumps(run(*json.loads(line))), flush=True)
