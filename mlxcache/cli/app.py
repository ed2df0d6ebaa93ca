"""The mlxcache command: run the demo or a server, inspect, copy, verify and trim caches.

Store subcommands live in :mod:`mlxcache.cli.store`; this module is the parser and the
rules every subcommand follows: one error line on stderr and a non-zero exit code for
anything not done, no traceback, ``-v`` for the backends' log lines.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from importlib.metadata import version

from mlxcache.cli.common import CLIError, check_reachable, errors, open_store
from mlxcache.cli.demo import DEFAULT_MAX_TOKENS, DEFAULT_PROMPT_TOKENS, run_demo
from mlxcache.cli.demo_lm import run_lm_demo
from mlxcache.cli.lifetimes import add_lifetime_commands
from mlxcache.cli.serve import serve
from mlxcache.cli.store import add_store_commands
from mlxcache.integrations.mlx_lm.files import FileError, export_file, import_file

DESCRIPTION = "Persistent, shareable prefix caches for MLX inference."
EPILOG = """cache URIs:
  file://~/.cache/mlxcache?max_bytes=20GiB   a folder shared by the processes of one machine
  redis://user:password@host:6379/0          a Redis server shared by many machines
  redis+cluster://h1:7000,h2:7001/           a Redis Cluster
  memory://                                  this process only
  (default: $MLXCACHE_URL, else file://~/.cache/mlxcache?max_bytes=20GiB)"""


def _need(module: str, extra: str, what: str) -> None:
    """A missing optional dependency is one line saying what to install."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise CLIError(f"{what} needs {module} ({exc}): pip install 'mlxcache[{extra}]'") from None


def cmd_demo(args: argparse.Namespace) -> int:
    if args.prompt_tokens < 64 or args.max_tokens < 1:
        raise CLIError("--prompt-tokens must be >= 64 and --max-tokens >= 1")
    if args.model_kind == "lm":
        _need("mlx_lm", "lm", "mlxcache demo --model-kind lm")
        return run_lm_demo(args.cache, prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens)
    _need("mlx_vlm", "vlm", "mlxcache demo")
    return run_demo(args.cache, prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens)


def cmd_import(args: argparse.Namespace) -> None:
    _need("mlx_lm", "lm", "mlxcache import")
    with open_store(args.uri) as backend:
        before = errors(backend)
        try:
            key, layers = import_file(args.file, backend, args.key)
        except FileError as exc:
            check_reachable(backend, before, args.uri)
            raise CLIError(str(exc)) from None
        check_reachable(backend, before, args.uri)
    print(f"imported {args.file} ({layers} layers) as {key}")


def cmd_export(args: argparse.Namespace) -> None:
    _need("mlx_lm", "lm", "mlxcache export")
    with open_store(args.uri, readonly=True) as backend:
        before = errors(backend)
        try:
            export_file(backend, args.key, args.file)
        except FileError as exc:
            check_reachable(backend, before, args.uri)
            raise CLIError(str(exc)) from None
    print(f"exported {args.key} to {args.file}")


def cmd_serve(args: argparse.Namespace) -> int:
    return serve(args.server_args)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
        help="print the backends' log lines",
    )  # fmt: skip
    p = argparse.ArgumentParser(
        prog="mlxcache", description=DESCRIPTION, epilog=EPILOG, parents=[common],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("--version", action="version", version=f"mlxcache {version('mlxcache')}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, func, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(
            name, help=help, description=help, parents=[common], epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )  # fmt: skip
        sp.set_defaults(func=func)
        return sp

    sp = add("demo", cmd_demo, "cold vs warm cached generation with a tiny local model")
    sp.add_argument("--cache", default=None, help="cache URI (default: $MLXCACHE_URL, else the "
                    "embedded default file://~/.cache/mlxcache?max_bytes=20GiB)")  # fmt: skip
    sp.add_argument(
        "--prompt-tokens", type=int, default=DEFAULT_PROMPT_TOKENS,
        help=f"prompt length (default {DEFAULT_PROMPT_TOKENS}, at least 64)",
    )  # fmt: skip
    sp.add_argument(
        "--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
        help=f"tokens to generate (default {DEFAULT_MAX_TOKENS})",
    )  # fmt: skip
    sp.add_argument(
        "--model-kind", choices=("vlm", "lm"), default="vlm",
        help="vlm: cached generation with a tiny VLM; lm: mlxcache serve with a tiny llama",
    )  # fmt: skip
    sp = add(
        "serve",
        cmd_serve,
        "an engine's own server (--engine mlx-lm, mlx-vlm or vllm-mlx; picked from the "
        "model's config) on a persistent prompt cache, on 127.0.0.1 unless --host",
    )
    sp.add_argument("server_args", nargs=argparse.REMAINDER, help="see mlxcache serve --help")
    sp = add("import", cmd_import, "store an mlx-lm prompt-cache file as one record")
    sp.add_argument("file", help="a .safetensors file from mlx_lm.cache_prompt")
    sp.add_argument("uri", help="the cache URI to store it in")
    sp.add_argument("--key", default=None, help="record key (default: mlx-lm/<file stem>)")
    sp = add("export", cmd_export, "write a record as an mlx-lm prompt-cache file")
    sp.add_argument("uri", help="the cache URI to read (opened read-only)")
    sp.add_argument("key", help="a record key, e.g. one that mlxcache import printed")
    sp.add_argument("file", help="where to write it (.safetensors)")
    add_store_commands(add)
    # pin / unpin / warm: entry lifetimes (mlxcache/cli_lifetimes.py)
    add_lifetime_commands(add)
    return p


def _closed_stdout() -> int:
    """The reader went away (``mlxcache ls | head``): no traceback, SIGPIPE's exit code."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except OSError:
        pass
    return 141


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:  # every other option is the engine server's: it parses them
        return cmd_serve(argparse.Namespace(server_args=argv[1:]))
    args = build_parser().parse_args(argv)
    logger = logging.getLogger("mlxcache")
    propagate = logger.propagate
    quiet = None
    if getattr(args, "verbose", False):
        logging.basicConfig(level=logging.INFO, format="mlxcache: %(levelname)s: %(message)s")
    else:
        logger.propagate = False  # a failure is reported once, by the error line
        quiet = logging.NullHandler()  # else logging's last-resort handler prints warnings
        logger.addHandler(quiet)
    try:
        code = args.func(args) or 0
        sys.stdout.flush()
        return code
    except CLIError as exc:
        print(f"mlxcache: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return _closed_stdout()
    except KeyboardInterrupt:
        print("mlxcache: interrupted", file=sys.stderr)
        return 130
    finally:
        logger.propagate = propagate
        if quiet is not None:
            logger.removeHandler(quiet)


if __name__ == "__main__":
    sys.exit(main())
