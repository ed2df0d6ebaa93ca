"""``mlxcache pin``, ``unpin`` and ``warm`` through the installed command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx_lm
from helpers import blob_record

import mlxcache
from mlxcache import PrefixCache, model_identity
from mlxcache.tiny_models import build_tiny_lm

MLXCACHE = str(Path(sys.executable).with_name("mlxcache"))
CHAT = [
    {"role": "system", "content": "You are a terse assistant. Answer in one short sentence."},
    {"role": "user", "content": "What is a prefix cache?"},
]


def mlxcache_cmd(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [MLXCACHE, *argv], capture_output=True, text=True, timeout=300, check=False
    )


def test_pin_and_unpin_keys_from_the_command_line(tmp_path, redis_url):
    for uri in (f"file://{tmp_path}/c", redis_url):
        with mlxcache.open_backend(uri) as b:
            b.put("sys", blob_record(1000))
        done = mlxcache_cmd("pin", uri, "sys")
        assert done.returncode == 0, done.stderr
        with mlxcache.open_backend(uri) as b:
            assert b.stats()["pinned_entries"] == 1
        done = mlxcache_cmd("pin", uri, "sys", "nope")
        assert done.returncode == 1 and done.stderr.count("\n") == 1
        assert "nope" in done.stderr and "Traceback" not in done.stderr
        assert mlxcache_cmd("unpin", uri, "sys").returncode == 0
        with mlxcache.open_backend(uri) as b:
            assert b.stats()["pinned_entries"] == 0 and "sys" in b
        done = mlxcache_cmd("unpin", uri, "sys")
        assert done.returncode == 1 and "not pinned" in done.stderr


def test_warm_prefills_prompts_a_later_lookup_reuses(tmp_path):
    uri = f"file://{tmp_path}/cache"
    ids = list(range(20, 60))
    lines = [
        {"model": "tiny", "messages": CHAT, "pin": True},
        {"model": "tiny", "token_ids": ids},
    ]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    done = mlxcache_cmd("warm", uri, str(prompts), "--block-size", "16", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] == 2 and report["failed"] == 0
    assert [p["pinned"] for p in report["prompts"]] == [True, False]

    model, tokenizer = mlx_lm.load(str(build_tiny_lm(tmp_path / "lm")))  # the same "tiny"
    cache = PrefixCache(uri, model=model_identity(model), block_size=16)
    chat_ids = list(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True))
    for prompt in (chat_ids, ids):
        hit = cache.lookup(prompt)
        assert hit is not None and hit.num_tokens == len(prompt) - 1  # all but the last
    assert cache.backend.stats()["pinned_entries"] > 0
    cache.close()

    again = mlxcache_cmd("warm", uri, str(prompts), "--block-size", "16")
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("warm ") == 2 and "0 stored" in again.stdout


def test_warm_kv_bits_fills_the_quantized_namespace(tmp_path):
    uri = f"file://{tmp_path}/cache"
    ids = list(range(20, 60))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"model": "tiny", "token_ids": ids}) + "\n")
    bad = mlxcache_cmd("warm", uri, str(prompts), "--kv-bits", "7")
    assert bad.returncode != 0 and "kv_bits must be one of" in bad.stderr
    done = mlxcache_cmd(
        "warm", uri, str(prompts), "--block-size", "16", "--kv-bits", "8", "--kv-group-size", "32"
    )
    assert done.returncode == 0, done.stderr
    model, _ = mlx_lm.load(str(build_tiny_lm(tmp_path / "lm")))
    name = model_identity(model)
    with PrefixCache(uri, model=name, block_size=16, kv_bits=8, kv_group_size=32) as q8:
        hit = q8.lookup(ids)
        assert hit is not None and hit.num_tokens == len(ids) - 1
    with PrefixCache(uri, model=name, block_size=16) as exact:  # another namespace
        assert exact.lookup(ids) is None


def test_warm_reports_a_failed_prompt_in_one_line(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"model": "tiny", "token_ids": [1, 2, 3]})
        + "\n"
        + json.dumps({"model": str(tmp_path / "no-such-model"), "token_ids": [1, 2]})
        + "\n"
    )
    done = mlxcache_cmd("warm", f"file://{tmp_path}/c", str(prompts))
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "1 of 2 prompts failed" in done.stderr
    assert "no-such-model" in done.stderr and "Traceback" not in done.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"model": "tiny"}\n')
    done = mlxcache_cmd("warm", f"file://{tmp_path}/c", str(bad))
    assert done.returncode == 1 and "exactly one of" in done.stderr
    assert done.stderr.count("\n") == 1
