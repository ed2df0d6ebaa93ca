"""The ``pin``, ``unpin`` and ``warm`` subcommands of ``mlxcache`` (entry lifetimes)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from typing import Any

from mlxcache.cli.common import CLIError, check_reachable, errors, open_store, print_json
from mlxcache.cli.warm import load_prompts, warm
from mlxcache.protocol import can_pin
from mlxcache.serializers import kv_quant


def cmd_pin(args: argparse.Namespace) -> None:
    """Pin (or unpin) keys; exit 1 naming the keys that were not changed."""
    with open_store(args.uri) as backend:
        if not can_pin(backend):
            raise CLIError(f"{type(backend).__name__} cannot pin entries")
        before = errors(backend)
        op = backend.pin if args.pin else backend.unpin
        failed = [key for key in args.keys if not op(key)]
        check_reachable(backend, before, args.uri)
    if failed:
        why = "not stored, or pin_max_bytes is full" if args.pin else "not pinned"
        raise CLIError(f"{len(failed)} key(s) {why}: {', '.join(failed)}")


def cmd_warm(args: argparse.Namespace) -> int:
    try:
        importlib.import_module("mlx_lm")
    except ImportError as exc:
        raise CLIError(f"mlxcache warm needs mlx_lm ({exc}): pip install 'mlxcache[lm]'") from None
    try:
        prompts = load_prompts(args.file)
    except (OSError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    if args.block_size < 1:
        raise CLIError(f"--block-size must be >= 1, got {args.block_size}")
    try:
        kv_quant.make(args.kv_bits, args.kv_group_size)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    open_store(args.uri).close()  # a bad URI or an unusable folder: one error line
    lines = None if args.json else sys.stdout
    report = warm(
        args.uri,
        prompts,
        block_size=args.block_size,
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
        stream=sys.stderr,
        lines=lines,
    )
    if args.json:
        print_json(report)
    failed = [r for r in report["prompts"] if r["error"]]
    if failed:
        first = failed[0]
        print(
            f"mlxcache: error: {len(failed)} of {len(prompts)} prompts failed "
            f"(line {first['line']}: {first['error']})",
            file=sys.stderr,
        )
        return 1
    return 0


def add_lifetime_commands(add: Callable[..., Any]) -> None:
    """Register the subcommands with ``add(name, func, help)`` of :func:`cli.build_parser`."""
    for name, on in (("pin", True), ("unpin", False)):
        what = (
            "keep keys out of LRU eviction and expiry (within pin_max_bytes)"
            if on
            else "make pinned keys ordinary LRU entries again"
        )
        sp = add(name, cmd_pin, what)
        sp.add_argument(
            "uri", help="cache URI, e.g. file://~/.cache/mlxcache or redis://127.0.0.1:6379/0"
        )
        sp.add_argument("keys", nargs="+", metavar="key", help="record keys (see mlxcache ls)")
        sp.set_defaults(pin=on)
    sp = add("warm", cmd_warm, "prefill the prompts of a JSON-lines file into the cache")
    sp.add_argument("uri", help="cache URI, e.g. file://~/.cache/mlxcache?max_bytes=20GiB")
    sp.add_argument(
        "file",
        help='JSON lines: {"model": PATH or "tiny", "messages": [...] or "token_ids": [...], '
        '"pin": false}',
    )
    sp.add_argument(
        "--block-size",
        type=int,
        default=256,
        help="PrefixCache block size of the readers (default 256, PrefixCache's)",
    )
    sp.add_argument(
        "--kv-bits",
        type=int,
        default=None,
        help="store KV quantized, as readers with PrefixCache(kv_bits=...) / mlxcache serve "
        "--cache-kv-bits expect (default exact)",
    )
    sp.add_argument(
        "--kv-group-size", type=int, default=64, help="the readers' kv_group_size (default 64)"
    )
    sp.add_argument("--json", action="store_true", help="one JSON report on stdout")
