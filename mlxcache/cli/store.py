"""The ``mlxcache`` subcommands that look after a store: stats, ls, inspect, rm, clear, gc,
copy and verify. Each exits non-zero when it could not do what was asked."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from mlxcache.backends.base import CacheBackend
from mlxcache.cli.common import (
    CLIError,
    check_reachable,
    errors,
    human_bytes,
    open_store,
    print_json,
    warn,
)
from mlxcache.cli.progress import Progress
from mlxcache.options import parse_size, redact_uri
from mlxcache.records import format as fmt

PREVIEW_ITEMS = 8
PREVIEW_CHARS = 80


def cmd_stats(args: argparse.Namespace) -> None:
    with open_store(args.uri, readonly=True) as backend:
        before = errors(backend)
        stats = backend.stats()
        check_reachable(backend, before, args.uri)
        if args.prometheus:
            try:  # prometheus_client is optional (the metrics extra)
                from mlxcache.metrics import render  # prometheus_client
            except ImportError as exc:
                raise CLIError(str(exc)) from None
            sys.stdout.write(render(backend).decode())
            return
    if args.json:
        print_json(stats)
        return
    for name, value in stats.items():
        if isinstance(value, dict):  # e.g. the fleet-wide counters
            print(f"{name:>14}")
            for sub, v in value.items():
                print(f"{sub:>14}  {v}")
        else:
            print(f"{name:>14}  {value}")


def cmd_ls(args: argparse.Namespace) -> None:
    with open_store(args.uri, readonly=True) as backend:
        before = errors(backend)
        keys = sorted(backend.keys(args.prefix))
        check_reachable(backend, before, args.uri)
    if args.json:
        print_json(keys)
    else:
        for key in keys:
            print(key)


def _header(backend: CacheBackend, key: str) -> fmt.Header | None:
    """The header of one record; no tensor data is read where the backend can avoid it."""
    header_of = getattr(backend, "header", None)  # BackendBase's; file and Redis read the header
    if header_of is not None:
        return header_of(key)
    record = backend.get(key)  # a protocol-only third-party backend
    return None if record is None else fmt.header_of(record)


def summarize(value: Any, name: str = "") -> Any:
    """Metadata fit to read: token ids as a count and their first ids, long things cut short."""
    if isinstance(value, bytes):
        if name == "tokens" and len(value) % 8 == 0:
            ids = [int.from_bytes(value[i : i + 8], "little", signed=True) for i in range(0, 64, 8)]
            ids = ids[: len(value) // 8]
            more = ", ..." if len(value) > 64 else ""
            return f"{len(value) // 8} tokens [{', '.join(map(str, ids))}{more}]"
        return f"<{len(value)} bytes>"
    if isinstance(value, str) and len(value) > PREVIEW_CHARS:
        return value[:PREVIEW_CHARS] + f"... ({len(value)} chars)"
    if isinstance(value, dict):
        return {str(k): summarize(v, str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        items = [summarize(v) for v in value[:PREVIEW_ITEMS]]
        if len(value) > PREVIEW_ITEMS:
            items.append(f"... ({len(value)} items)")
        return items
    return value


def _tokens_json(value: Any, name: str = "") -> Any:
    """Metadata for ``--json``: token ids as lists of ints, other bytes as hex."""
    if isinstance(value, bytes):
        if name == "tokens" and len(value) % 8 == 0:
            return [int.from_bytes(value[i : i + 8], "little", signed=True)
                    for i in range(0, len(value), 8)]  # fmt: skip
        return value.hex()
    if isinstance(value, dict):
        return {str(k): _tokens_json(v, str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_tokens_json(v) for v in value]
    return value


def cmd_inspect(args: argparse.Namespace) -> None:
    with open_store(args.uri, readonly=True) as backend:
        before = errors(backend)
        header = _header(backend, args.key)
        check_reachable(backend, before, args.uri)
    if header is None:
        raise CLIError(f"no such key: {args.key}")
    info = fmt.describe(header)
    if args.json:
        info["meta"] = _tokens_json(header.meta)
        print_json(info)
        return
    for name in ("format_version", "checksum", "bytes"):
        if name in info:
            print(f"{name}: {info[name]}")
    print("meta:")
    for name, value in summarize(header.meta).items():
        print(f"  {name}: {value}")
    print(f"tensors: {len(info['tensors'])}")
    for t in info["tensors"][:50]:
        print(f"  {t['name']:<40} {t['dtype']:<6} {str(tuple(t['shape'])):<24} {t['bytes']}")
    if len(info["tensors"]) > 50:
        print(f"  ... ({len(info['tensors']) - 50} more; --json lists them all)")


def cmd_rm(args: argparse.Namespace) -> None:
    with open_store(args.uri) as backend:
        before = errors(backend)
        missing = [key for key in args.keys if not backend.delete(key)]
        check_reachable(backend, before, args.uri)
    if missing:
        raise CLIError(f"no such key: {', '.join(missing)}")


def cmd_clear(args: argparse.Namespace) -> None:
    if not args.yes:
        if not sys.stdin.isatty():
            raise CLIError("refusing to clear without --yes (no terminal to ask on)")
        answer = input(f"Delete every entry in {redact_uri(args.uri)}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            raise CLIError("not cleared")
    with open_store(args.uri) as backend:
        before = errors(backend)
        backend.clear()
        check_reachable(backend, before, args.uri)


def cmd_gc(args: argparse.Namespace) -> None:
    """Evict least-recently-used entries until the cache fits ``--max-bytes``."""
    try:
        max_bytes = parse_size(args.max_bytes)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    with open_store(args.uri) as backend:
        before = errors(backend)
        trim = getattr(backend, "trim", None)
        if trim is None:
            raise CLIError(f"the backend of {redact_uri(args.uri)} cannot evict on demand")
        start = backend.stats()
        evicted = trim(max_bytes)
        stats = backend.stats()
        check_reachable(backend, before, args.uri)
    result = {
        "bytes_before": start["bytes"],
        "bytes_after": stats["bytes"],
        "entries": stats["entries"],
        "evicted": evicted,
    }
    if args.json:
        print_json(result)
    else:
        print(
            f"{result['bytes_before']} -> {result['bytes_after']} bytes, evicted {evicted}, "
            f"{stats['entries']} entries left"
        )


def cmd_copy(args: argparse.Namespace) -> None:
    """Copy every entry; the destination's own answer (not our put) says what it kept, asked
    once at the end (one batch), so entries it evicted again during the copy count as lost."""
    sizes: dict[str, int] = {}
    with open_store(args.src, readonly=True) as src, open_store(args.dst) as dst:
        src_before, dst_before = errors(src), errors(dst)
        keys = sorted(src.keys(args.prefix))
        check_reachable(src, src_before, args.src)
        len(dst)  # is the destination there at all? (even with nothing to copy)
        check_reachable(dst, dst_before, args.dst)
        with Progress("copy", len(keys), unit="entries") as bar:
            for key in keys:
                record = src.get(key)
                if record is not None:
                    dst.put(key, record)
                    sizes[key] = record.nbytes
                bar.advance(nbytes=0 if record is None else record.nbytes)
        there = dst.contains_many(list(sizes))
        check_reachable(src, src_before, args.src)
        check_reachable(dst, dst_before, args.dst)
    missing = [k for k, ok in zip(sizes, there, strict=True) if not ok]
    found, kept = len(sizes), len(sizes) - len(missing)
    nbytes = sum(n for (k, n), ok in zip(sizes.items(), there, strict=True) if ok)
    result = {"keys": len(keys), "read": found, "kept": kept, "bytes": nbytes}
    if args.json:
        print_json({**result, "copied": kept, "not_kept": missing})
    else:
        print(f"copied {kept} of {len(keys)} entries ({human_bytes(nbytes)})")
    if found < len(keys):
        raise CLIError(f"{len(keys) - found} entries of {redact_uri(args.src)} could not be read")
    if missing:
        raise CLIError(
            f"the destination kept {kept} of {found} entries (over its max_bytes?): "
            f"first not kept: {missing[0]}"
        )


def cmd_verify(args: argparse.Namespace) -> int:
    """Read every record (each checksum, or MAC with a secret, is verified) and report the bad
    ones with why; the store removes or quarantines them (said in the report), unless it is
    read-only."""
    bad: dict[str, str] = {}
    if args.readonly and not args.uri.lower().startswith("file:"):
        raise CLIError("--readonly works on file:// (Redis drops unreadable values as it reads)")
    backend = open_store(args.uri, readonly=True)  # a missing cache is an error, not created
    if not args.readonly:
        try:
            writable = open_store(args.uri)
        except CLIError:  # a folder we may not write: report only
            warn(f"{redact_uri(args.uri)} is not writable: bad entries are reported, not removed")
        else:
            backend.close()
            backend = writable
    readonly = bool(getattr(backend, "readonly", False))
    checked = nbytes = 0
    with backend:
        listed = errors(backend)
        keys = sorted(backend.keys(args.prefix))
        check_reachable(backend, listed, args.uri)  # an unreachable store is not "0 bad"
        with Progress("verify", len(keys), unit="entries") as bar:
            for key in keys:
                before = errors(backend, rejected=True)
                record = backend.get(key)
                if record is None and errors(backend, rejected=True) > before:
                    bad[key] = str(getattr(backend, "last_error", None) or "unreadable")
                elif record is not None:
                    checked += 1
                    nbytes += record.nbytes
                bar.advance(nbytes=0 if record is None else record.nbytes)
    action = "kept (read-only)" if readonly else "removed"
    if args.json:
        print_json({"checked": len(keys), "good": checked, "bytes": nbytes, "bad": sorted(bad),
                    "reasons": bad, "bad_entries": action})  # fmt: skip
    else:
        print(f"checked {len(keys)} entries ({human_bytes(nbytes)} verified), {len(bad)} bad")
        for key, why in bad.items():
            print(f"bad ({action}): {key}: {why}")
    return 1 if bad else 0


def add_store_commands(add: Any) -> None:
    """The store subcommands, on a ``add(name, func, help) -> parser`` of the main parser."""
    uri_help = "a cache URI, e.g. file://~/.cache/mlxcache or redis://host:6379/0"
    sp = add("stats", cmd_stats, "a store's entries, bytes and counters (read-only)")
    sp.add_argument("uri", help=uri_help)
    sp.add_argument("--json", action="store_true", help="one JSON object")
    sp.add_argument(
        "--prometheus", action="store_true", help="Prometheus text format (the metrics extra)"
    )
    sp = add("ls", cmd_ls, "list keys (read-only)")
    sp.add_argument("uri", help=uri_help)
    sp.add_argument("--prefix", default="", help="only keys starting with this")
    sp.add_argument("--json", action="store_true", help="one JSON list")
    sp = add("inspect", cmd_inspect, "one record's header, metadata and tensors (read-only)")
    sp.add_argument("uri", help=uri_help)
    sp.add_argument("key", help="the record's key (see mlxcache ls)")
    sp.add_argument("--json", action="store_true", help="everything, token ids as lists")
    sp = add("rm", cmd_rm, "delete keys; exit 1 if one was not there")
    sp.add_argument("uri", help=uri_help)
    sp.add_argument("keys", nargs="+", metavar="key", help="keys to delete")
    sp = add("clear", cmd_clear, "delete every entry (asks unless --yes)")
    sp.add_argument("uri", help=uri_help)
    sp.add_argument("--yes", "-y", action="store_true", help="do not ask")
    sp = add("gc", cmd_gc, "evict least recently used entries down to --max-bytes")
    sp.add_argument("uri", help=uri_help)
    sp.add_argument("--max-bytes", required=True, help="the budget, e.g. 10GiB, 512MiB, 1.5GB")
    sp.add_argument("--json", action="store_true", help="one JSON object")
    sp = add("copy", cmd_copy, "copy every entry from SRC to DST; exit 1 unless DST kept all")
    sp.add_argument("src", help="where to read, e.g. file:///srv/kv (opened read-only)")
    sp.add_argument("dst", help="where to write, e.g. redis://cache-host:6379/0")
    sp.add_argument("--prefix", default="", help="only keys starting with this")
    sp.add_argument("--json", action="store_true", help="one JSON object")
    sp = add("verify", cmd_verify, "check every record's checksum (MAC with a secret); exit 1 "
             "if any is bad (bad entries are removed or quarantined)")  # fmt: skip
    sp.add_argument("uri", help=uri_help)
    sp.add_argument("--prefix", default="", help="only keys starting with this")
    sp.add_argument("--readonly", action="store_true", help="report bad entries, remove none")
    sp.add_argument("--json", action="store_true", help="one JSON object")
