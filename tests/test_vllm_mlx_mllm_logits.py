"""vllm-mlx's batched MLLM path on the shared tier: a text-only prompt whose exact entry holds
its last logits is answered from that entry's own KV, never from a shorter shared prefix.

For a model whose cache cannot be rewound (recurrent layers: a tiny qwen3_next), vllm-mlx's
``MLLMBatchGenerator`` stores each cold text-only prompt with its last logits; when the same
prompt comes again it reads them (``fetch_exact_auxiliary``), samples the first token from
them with the cache ``fetch`` returns, and prefills nothing. The shared tier, which answers
the scheduler's exact matches with its all-but-one-token prefix, must not answer this one:
the KV would lack the prompt's tail. vllm-mlx's own generator runs in its venv (as in
test_vllm_mlx_server.py) on a ``file://`` backend; every answer is compared with the same
generator with its prefix cache off.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from vllm_servers import require_vllm_python

CONFIG = json.loads((Path(__file__).parent / "families" / "mlx_lm_configs.json").read_text())

SCRIPT = r"""
import hashlib, importlib, json, sys, threading
import mlx.core as mx
import numpy as np
from mlxcache.integrations.vllm_mlx import mllm_salts, salts, seam

config, budget, salt, root = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
mx.random.seed(0)
model = arch.Model(arch.ModelArgs.from_dict(config))
mx.eval(model.parameters())
seam.install(f"file://{root}", block_size=16)
mllm_salts.install()
from vllm_mlx import mllm_batch_generator as g
from vllm_mlx.memory_cache import MemoryCacheConfig

PROMPT = np.random.default_rng(1).integers(1, 1000, size=72).tolist()
SHORTER = 48  # a prefix of PROMPT at a block boundary: the shared tier can restore it
served = []

def generator(cached):
    conf = MemoryCacheConfig(max_memory_mb=256, min_prefix_tokens=16) if cached else None
    gen = g.MLLMBatchGenerator(model, None, prefix_cache_config=conf, enable_vision_cache=False)
    if budget:  # vllm-mlx's interleaved prefill (--chunked-prefill-tokens)
        g.install_chunked_prefill_mllm(gen, budget=budget)
    return gen

def answer(gen, ids):
    req = g.MLLMBatchRequest(uid=0, request_id=f"r{len(served)}", prompt="", max_tokens=6,
                             temperature=0.0)
    req.input_ids, req.mlxcache_salt = mx.array(ids), salt
    served.append(req)
    gen.insert([req])
    tokens, digest = [], hashlib.sha256()
    while True:
        for r in gen.next():
            tokens.append(int(r.token))
            digest.update(np.array(r.logprobs).tobytes())
            if r.finish_reason:
                return [tokens, digest.hexdigest()]

reference = answer(generator(False), PROMPT)
server, other = generator(True), generator(True)  # two servers on one backend
cold = answer(server, PROMPT)  # a miss: stored with its last logits
answer(other, PROMPT[:SHORTER])  # the other server stores a shorter prefix of it
cache = server.prefix_cache
salts.admit(salt, None)
tier = cache._tier(salt)
entry = cache._entries[tuple(salts.salted(PROMPT, salt))]
before, tier_before = cache.get_stats(), tier.stats()
salts.admit("", None)
warm = answer(server, PROMPT)
after, tier_after = cache.get_stats(), tier.stats()
salts.admit(salt, None)
cache.fetch_exact_auxiliary(PROMPT)  # read on this thread: another thread's fetch is its own
elsewhere = []
thread = threading.Thread(target=lambda: (salts.admit(salt, None),
                                          elsewhere.append(len(cache.fetch(PROMPT)[1]))))
thread.start()
thread.join()
here = len(cache.fetch(PROMPT)[1])
_, remaining = cache.fetch(PROMPT)  # as the text scheduler fetches: the tier's prefix
print(json.dumps({
    "remaining": [elsewhere[0], here, len(remaining)],
    "reference": reference, "cold": cold, "warm": warm,
    "logits": "last_logits" in (entry.auxiliary or {}),
    "shorter": tier.prefix.lookup(PROMPT[:-1]).num_tokens,
    "hits": after["hits"] - before["hits"],
    "tokens_saved": after["tokens_saved"] - before["tokens_saved"],
    "tier_hits": tier_after["hits"] - tier_before["hits"],
}))
"""


@pytest.mark.parametrize(
    ("budget", "salt"),
    [(0, ""), (32, ""), (0, "alice")],
    ids=["batched", "interleaved-prefill", "salted"],
)
def test_an_exact_entry_with_logits_is_its_own_kv(tmp_path, budget, salt):
    run = subprocess.run(
        [require_vllm_python(), "-c", SCRIPT, json.dumps(CONFIG["qwen3_next"]), str(budget),
         salt, str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=os.getcwd()),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    # the case is real: the entry holds its logits, the tier a shorter prefix of the prompt
    assert out["logits"] and out["shorter"] == 48
    assert out["cold"] == out["reference"]
    assert out["warm"] == out["reference"]  # tokens and the bytes of every log-probability
    # counted as what it was: vllm-mlx's exact hit of all 72 tokens, not a shared-tier hit
    assert (out["hits"], out["tokens_saved"], out["tier_hits"]) == (1, 72, 0)
    # a fetch without the logits read on its thread just before (the text scheduler's, or
    # another thread's) still gets the tier's prefix; after the read, the exact entry
    assert out["remaining"] == [72 - 48, 0, 72 - 48]
