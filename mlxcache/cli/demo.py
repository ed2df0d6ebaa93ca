"""``mlxcache demo``: cold vs warm time to first token, the warm one from a new process.

Builds a tiny Qwen2-VL with seeded random weights (nothing downloaded), runs a request with an
image cold, then the same request and a follow-up turn in a new Python process against the
same cache, and prints time to first token, tokens reused and whether the outputs match.
Each run uses a fresh salt, so the cold request is really cold however often the demo runs,
and deletes its entries at the end.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Sequence
from typing import Any, TextIO

import mlx.core as mx
import numpy as np

from mlxcache.cli.progress import Progress
from mlxcache.integrations.mlx_vlm.generate import generate_tokens
from mlxcache.options import redact_uri
from mlxcache.prefix.cache import PrefixCache
from mlxcache.prefix.model_id import model_identity
from mlxcache.tiny_models import build_model
from mlxcache.uri import default_uri

MODEL = "qwen2_vl"
SEED = 0
VISION_START, IMAGE_TOKEN, IMAGE_TOKENS = 997, 999, 16
DEFAULT_PROMPT_TOKENS = 1536
DEFAULT_MAX_TOKENS = 16
FOLLOWUP_TOKENS = 24  # the new question of turn 2


def prompt_ids(n: int, seed: int = 1) -> list[int]:
    """A seeded ``n``-token prompt: some text, one image (vision start + 16 image tokens), text."""
    if n < IMAGE_TOKENS + 8:
        raise ValueError(f"prompt_tokens must be at least {IMAGE_TOKENS + 8}")
    ids = np.random.default_rng(seed).integers(1, VISION_START, size=n).tolist()
    ids[5] = VISION_START
    ids[6 : 6 + IMAGE_TOKENS] = [IMAGE_TOKEN] * IMAGE_TOKENS
    return ids


def image_inputs(seed: int = 2) -> tuple[Any, dict[str, Any]]:
    """Seeded ``pixel_values`` of one 112x112 image as Qwen2-VL patches, and its grid."""

    pixels = np.random.default_rng(seed).standard_normal((64, 3 * 2 * 14 * 14))
    return mx.array(pixels.astype(np.float32)), {"image_grid_thw": mx.array([[1, 8, 8]])}


def followup_ids(prompt: list[int], answer: list[int]) -> list[int]:
    """Turn 2: turn 1's prompt, its answer and a new question."""
    question = np.random.default_rng(3).integers(1, VISION_START, size=FOLLOWUP_TOKENS).tolist()
    return prompt + answer + question


def _open(uri: str, salt: str, block_size: int, model: Any) -> Any:

    return PrefixCache(uri, model=model_identity(model), block_size=block_size, salt=salt)


def _request(model: Any, cache: Any, ids: list[int], max_tokens: int) -> dict[str, Any]:

    pixel_values, kwargs = image_inputs()
    r = generate_tokens(
        model, mx.array([ids]), pixel_values, cache=cache, max_tokens=max_tokens, **kwargs
    )
    return {
        "tokens": r.tokens,
        "ttft": r.time_to_first_token,
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "vision_cached": r.vision_cached,
    }


def worker(uri: str, salt: str, prompt_tokens: int, max_tokens: int, block_size: int, answer):
    """The new process: the same request warm, a follow-up warm, the follow-up uncached."""

    model, _ = build_model(MODEL, SEED)
    cache = _open(uri, salt, block_size, model)
    ids = prompt_ids(prompt_tokens)
    same = _request(model, cache, ids, max_tokens)
    follow = followup_ids(ids, answer)
    warm = _request(model, cache, follow, max_tokens)
    reference = _request(model, None, follow, max_tokens)
    return {"same": same, "followup": warm, "followup_uncached": reference}


def _table(rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run_demo(
    cache_uri: str | None = None,
    *,
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    block_size: int = 256,
    out: TextIO | None = None,
) -> int:
    """Run the demo on ``cache_uri`` (default: ``$MLXCACHE_URL`` or ~/.cache/mlxcache).

    Returns 0 when the warm outputs match and the new process reused the cached prefix.
    """

    out = out or sys.stdout
    uri = cache_uri or default_uri()
    if uri.lower().startswith("memory:"):
        print(
            "mlxcache demo: a memory:// cache lives in one process; use file:// or redis://",
            file=sys.stderr,
        )
        return 2
    salt = f"mlxcache-demo-{uuid.uuid4().hex[:16]}"  # a fresh namespace: the cold run is cold

    with Progress("demo", total=3) as bar:
        bar.phase("building the tiny Qwen2-VL (random weights, nothing downloaded)")
        model, _ = build_model(MODEL, SEED)
        try:
            cache = _open(uri, salt, block_size, model)
        except (ValueError, TypeError, OSError) as e:
            print(f"mlxcache demo: cannot open the cache {redact_uri(uri)}: {e}", file=sys.stderr)
            return 2
        bar.advance()
        bar.phase(f"cold request: prefill of {prompt_tokens} tokens with an image, then store")
        ids = prompt_ids(prompt_tokens)
        cold = _request(model, cache, ids, max_tokens)
        bar.advance()
        bar.phase("a new process: the same request warm, a follow-up turn, the follow-up uncached")
        cmd = [sys.executable, "-m", "mlxcache.cli.demo", "--worker", "--cache", uri,
               "--salt", salt, "--prompt-tokens", str(prompt_tokens),
               "--max-tokens", str(max_tokens), "--block-size", str(block_size),
               "--answer", ",".join(map(str, cold["tokens"]))]  # fmt: skip
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in [_package_root(), env.get("PYTHONPATH")] if p
        )
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        finally:
            cache.clear()  # this run's salt is never used again: leave nothing behind
            cache.close()
        bar.advance()
    if proc.returncode != 0:
        print(f"mlxcache demo: the new process failed:\n{proc.stderr.strip()}", file=sys.stderr)
        return 1
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    same, follow, ref = res["same"], res["followup"], res["followup_uncached"]
    same_ok = same["tokens"] == cold["tokens"]
    follow_ok = follow["tokens"] == ref["tokens"]

    def reused(r: dict[str, Any]) -> str:
        return f"{r['cached_tokens']} / {r['prompt_tokens']}"

    rows = [
        ("request", "process", "time to first token", "tokens reused", "vision encoder", "output"),
        ("cold", "1", f"{cold['ttft'] * 1000:.0f} ms", reused(cold), "ran", "(reference)"),
        ("same again", "2 (new)", f"{same['ttft'] * 1000:.0f} ms", reused(same),
         "skipped" if same["vision_cached"] else "ran",
         "matches cold" if same_ok else "DIFFERS from cold"),
        ("follow-up turn", "2 (new)", f"{follow['ttft'] * 1000:.0f} ms", reused(follow),
         "skipped" if follow["vision_cached"] else "ran",
         "matches uncached" if follow_ok else "DIFFERS from uncached"),
    ]  # fmt: skip
    print(f"mlxcache demo: tiny Qwen2-VL (random weights), {prompt_tokens}-token prompt with one "
          f"image, {max_tokens} greedy tokens, cache {redact_uri(uri)}", file=out)  # fmt: skip
    print(_table(rows), file=out)
    ratio = cold["ttft"] / same["ttft"] if same["ttft"] > 0 else float("inf")
    print(f"warm time to first token from a new process: {ratio:.1f}x lower than cold", file=out)
    if not (same["cached_tokens"] and follow["cached_tokens"]):
        print("the new process reused nothing: is the cache reachable and writable?", file=out)
    ok = same_ok and follow_ok and same["cached_tokens"] > 0 and follow["cached_tokens"] > 0
    return 0 if ok else 1


def _package_root() -> str:
    """The folder holding the ``mlxcache`` package, so the new process imports this copy."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlxcache.cli.demo", description=__doc__)
    p.add_argument("--cache", default=None, help="cache URI (default: the embedded default)")
    p.add_argument("--prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS)
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--salt", default="", help=argparse.SUPPRESS)
    p.add_argument("--answer", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.worker:
        return run_demo(
            args.cache,
            prompt_tokens=args.prompt_tokens,
            max_tokens=args.max_tokens,
            block_size=args.block_size,
        )
    logging.basicConfig(level=logging.WARNING)
    answer = [int(t) for t in args.answer.split(",") if t]
    res = worker(args.cache, args.salt, args.prompt_tokens, args.max_tokens, args.block_size,
                 answer)  # fmt: skip
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
