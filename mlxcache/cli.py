"""The ``mlxcache`` command: inspect, copy, verify and trim caches; run the demo."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from mlxcache import format as fmt
from mlxcache.backends.base import CacheBackend
from mlxcache.demo import DEFAULT_MAX_TOKENS, DEFAULT_PROMPT_TOKENS, run_demo
from mlxcache.options import parse_size, redact_uri
from mlxcache.progress import Progress
from mlxcache.uri import open_backend


class CLIError(Exception):
    """A failure reported as one line and a non-zero exit code."""


def _open(uri: str, **options: Any) -> CacheBackend:
    try:
        return open_backend(uri, **options)
    except (ValueError, TypeError, OSError) as exc:
        raise CLIError(str(exc)) from None


def _errors(backend: CacheBackend) -> int:
    return int(backend.stats().get("errors", 0))


def _check_reachable(backend: CacheBackend, before: int, uri: str) -> None:
    """The backends turn store failures into misses; the CLI turns them back into an error."""
    if _errors(backend) > before:
        cause = getattr(backend, "last_error", None) or "unreachable or unreadable"
        raise CLIError(f"the cache at {redact_uri(uri)} failed: {cause}")


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=None, sort_keys=True, default=str))


def cmd_stats(args: argparse.Namespace) -> None:
    with _open(args.uri) as backend:
        before = _errors(backend)
        stats = backend.stats()
        _check_reachable(backend, before, args.uri)
        if args.prometheus:
            try:  # prometheus_client is optional (the metrics extra)
                from mlxcache.metrics import render
            except ImportError as exc:
                raise CLIError(str(exc)) from None
            sys.stdout.write(render(backend).decode())
            return
    if args.json:
        _print_json(stats)
    else:
        for name, value in stats.items():
            print(f"{name:>12}  {value}")


def cmd_ls(args: argparse.Namespace) -> None:
    with _open(args.uri) as backend:
        before = _errors(backend)
        keys = sorted(backend.keys(args.prefix))
        _check_reachable(backend, before, args.uri)
    if args.json:
        _print_json(keys)
    else:
        for key in keys:
            print(key)


def _describe(backend: CacheBackend, key: str) -> dict[str, Any] | None:
    """Header, tensors and sizes of one record; no tensor data is loaded where avoidable."""
    header_of = getattr(backend, "header", None)  # BackendBase's; file and Redis read the header
    if header_of is not None:
        header = header_of(key)
    else:  # a protocol-only third-party backend
        record = backend.get(key)
        header = None if record is None else fmt.header_of(record)
    return None if header is None else fmt.describe(header)


def cmd_inspect(args: argparse.Namespace) -> None:
    with _open(args.uri) as backend:
        before = _errors(backend)
        info = _describe(backend, args.key)
        _check_reachable(backend, before, args.uri)
    if info is None:
        raise CLIError(f"no such key: {args.key}")
    if args.json:
        _print_json(info)
        return
    for name in ("format_version", "checksum", "bytes"):
        if name in info:
            print(f"{name}: {info[name]}")
    print(f"meta: {json.dumps(info['meta'], sort_keys=True, default=str)[:2000]}")
    print(f"tensors: {len(info['tensors'])}")
    for t in info["tensors"]:
        print(f"  {t['name']:<40} {t['dtype']:<6} {str(tuple(t['shape'])):<24} {t['bytes']}")


def cmd_rm(args: argparse.Namespace) -> None:
    with _open(args.uri) as backend:
        before = _errors(backend)
        missing = [key for key in args.keys if not backend.delete(key)]
        _check_reachable(backend, before, args.uri)
    if missing:
        raise CLIError(f"no such key: {', '.join(missing)}")


def cmd_clear(args: argparse.Namespace) -> None:
    if not args.yes:
        if not sys.stdin.isatty():
            raise CLIError("refusing to clear without --yes (no terminal to ask on)")
        answer = input(f"Delete every entry in {redact_uri(args.uri)}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            raise CLIError("not cleared")
    with _open(args.uri) as backend:
        before = _errors(backend)
        backend.clear()
        _check_reachable(backend, before, args.uri)


def cmd_gc(args: argparse.Namespace) -> None:
    """Evict least-recently-used entries until the cache fits ``--max-bytes``."""
    try:
        max_bytes = parse_size(args.max_bytes)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    with _open(args.uri) as backend:
        before_bytes = backend.stats()["bytes"]
    with _open(args.uri) as backend:
        before = _errors(backend)
        trim = getattr(backend, "trim", None)
        if trim is None:
            raise CLIError(f"the backend of {args.uri} cannot evict on demand (no trim())")
        trim(max_bytes)
        stats = backend.stats()
        _check_reachable(backend, before, args.uri)
    result = {
        "bytes_before": before_bytes,
        "bytes_after": stats["bytes"],
        "entries": stats["entries"],
    }
    if args.json:
        _print_json(result)
    else:
        print(
            f"{result['bytes_before']} -> {result['bytes_after']} bytes, {stats['entries']} entries"
        )


def cmd_copy(args: argparse.Namespace) -> None:
    copied = 0
    with _open(args.src) as src, _open(args.dst) as dst:
        src_before, dst_before = _errors(src), _errors(dst)
        keys = sorted(src.keys(args.prefix))
        with Progress("copy", len(keys)) as bar:
            for key in keys:
                record = src.get(key)
                if record is not None:
                    dst.put(key, record)
                    copied += 1
                bar.advance()
        _check_reachable(src, src_before, args.src)
        _check_reachable(dst, dst_before, args.dst)
    if args.json:
        _print_json({"copied": copied, "keys": len(keys)})
    else:
        print(f"copied {copied} of {len(keys)} entries")


def _failures(backend: CacheBackend) -> int:
    stats = backend.stats()
    return int(stats.get("errors", 0)) + int(stats.get("rejected", 0))


def cmd_verify(args: argparse.Namespace) -> int:
    """Read every record (the backends verify each checksum, or MAC with a secret) and report
    the bad ones with why: corrupt, unsigned, forged or signed with a secret not accepted."""
    bad: list[str] = []
    why: dict[str, str] = {}
    with _open(args.uri) as backend:
        listed = _errors(backend)
        keys = sorted(backend.keys(args.prefix))
        _check_reachable(backend, listed, args.uri)  # an unreachable store is not "0 bad"
        with Progress("verify", len(keys)) as bar:
            for key in keys:
                before = _failures(backend)
                if backend.get(key) is None and _failures(backend) > before:
                    bad.append(key)
                    why[key] = str(getattr(backend, "last_error", None) or "unreadable")
                bar.advance()
    if args.json:
        _print_json({"checked": len(keys), "bad": bad, "reasons": why})
    else:
        print(f"checked {len(keys)} entries, {len(bad)} bad")
        for key in bad:
            print(f"bad: {key}: {why[key]}")
    return 1 if bad else 0


def cmd_demo(args: argparse.Namespace) -> int:
    if args.prompt_tokens < 64 or args.max_tokens < 1:
        raise CLIError("--prompt-tokens must be >= 64 and --max-tokens >= 1")
    if args.model_kind == "lm":
        from mlxcache.demo_lm import run_lm_demo

        return run_lm_demo(args.cache, prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens)
    return run_demo(args.cache, prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens)


def cmd_import(args: argparse.Namespace) -> None:
    from mlxcache.integrations.mlx_lm_files import FileError, import_file

    with _open(args.uri) as backend:
        before = _errors(backend)
        try:
            key, layers = import_file(args.file, backend, args.key)
        except FileError as exc:
            _check_reachable(backend, before, args.uri)
            raise CLIError(str(exc)) from None
        _check_reachable(backend, before, args.uri)
    print(f"imported {args.file} ({layers} layers) as {key}")


def cmd_export(args: argparse.Namespace) -> None:
    from mlxcache.integrations.mlx_lm_files import FileError, export_file

    with _open(args.uri) as backend:
        before = _errors(backend)
        try:
            export_file(backend, args.key, args.file)
        except FileError as exc:
            _check_reachable(backend, before, args.uri)
            raise CLIError(str(exc)) from None
    print(f"exported {args.key} to {args.file}")


def cmd_serve(args: argparse.Namespace) -> int:
    from mlxcache.integrations.mlx_lm_server import main as serve

    return serve(args.server_args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mlxcache", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="print the backends' log lines")
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, func, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help)
        sp.set_defaults(func=func)
        return sp

    sp = add("demo", cmd_demo, "cold vs warm cached generation with a tiny local VLM")
    sp.add_argument(
        "--cache",
        default=None,
        help="cache URI (default: $MLXCACHE_URL or file://~/.cache/mlxcache)",
    )
    sp.add_argument(
        "--prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS, help="prompt length"
    )
    sp.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="tokens to generate")
    sp.add_argument(
        "--model-kind",
        choices=("vlm", "lm"),
        default="vlm",
        help="vlm: cached generation with a tiny VLM; lm: mlxcache serve with a tiny llama",
    )
    sp = add("serve", cmd_serve, "mlx-lm's OpenAI-compatible server on a persistent prompt cache")
    sp.add_argument("server_args", nargs=argparse.REMAINDER, help="see mlxcache serve --help")
    sp = add("import", cmd_import, "store an mlx-lm prompt-cache file as one record")
    sp.add_argument("file", help="a .safetensors file from mlx_lm.cache_prompt")
    sp.add_argument("uri")
    sp.add_argument("--key", default=None, help="record key (default: mlx-lm/<file stem>)")
    sp = add("export", cmd_export, "write a record as an mlx-lm prompt-cache file")
    sp.add_argument("uri")
    sp.add_argument("key", help="a record key, e.g. one that mlxcache import printed")
    sp.add_argument("file", help="where to write it (.safetensors)")
    sp = add("stats", cmd_stats, "print a backend's stats")
    sp.add_argument("uri")
    sp.add_argument("--json", action="store_true", help="one JSON object")
    sp.add_argument(
        "--prometheus", action="store_true", help="Prometheus text format (the metrics extra)"
    )
    sp = add("ls", cmd_ls, "list keys")
    sp.add_argument("uri")
    sp.add_argument("--prefix", default="")
    sp.add_argument("--json", action="store_true")
    sp = add("inspect", cmd_inspect, "show one record's header, tensors and sizes")
    sp.add_argument("uri")
    sp.add_argument("key")
    sp.add_argument("--json", action="store_true")
    sp = add("rm", cmd_rm, "delete keys")
    sp.add_argument("uri")
    sp.add_argument("keys", nargs="+", metavar="key")
    sp = add("clear", cmd_clear, "delete every entry (asks unless --yes)")
    sp.add_argument("uri")
    sp.add_argument("--yes", "-y", action="store_true")
    sp = add("gc", cmd_gc, "evict least recently used entries down to --max-bytes")
    sp.add_argument("uri")
    sp.add_argument("--max-bytes", required=True, help="e.g. 10GiB")
    sp.add_argument("--json", action="store_true")
    sp = add("copy", cmd_copy, "copy every entry from SRC to DST (e.g. warm Redis from disk)")
    sp.add_argument("src")
    sp.add_argument("dst")
    sp.add_argument("--prefix", default="")
    sp.add_argument("--json", action="store_true")
    sp = add("verify", cmd_verify, "check every record (checksum, or MAC); exit 1 if any is bad")
    sp.add_argument("uri")
    sp.add_argument("--prefix", default="")
    sp.add_argument("--json", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:  # every other option is mlx_lm.server's: it parses them
        return cmd_serve(argparse.Namespace(server_args=argv[1:]))
    args = build_parser().parse_args(argv)
    logger = logging.getLogger("mlxcache")
    propagate = logger.propagate
    quiet = None
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="mlxcache: %(levelname)s: %(message)s")
    else:
        logger.propagate = False  # a failure is reported once, by the error line
        quiet = logging.NullHandler()  # else logging's last-resort handler prints warnings
        logger.addHandler(quiet)
    try:
        return args.func(args) or 0
    except CLIError as exc:
        print(f"mlxcache: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("mlxcache: interrupted", file=sys.stderr)
        return 130
    finally:
        logger.propagate = propagate
        if quiet is not None:
            logger.removeHandler(quiet)


if __name__ == "__main__":
    sys.exit(main())
