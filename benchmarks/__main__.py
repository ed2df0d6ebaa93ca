"""``python -m benchmarks``: throughput, prefix lookup, TTFT, peak memory, the mlx-lm server,
the peers side by side, the growth curves, restores for another worker and the agent workload
(in process, and over HTTP against each engine's stock server), in one run; the soak
(``--only soak --minutes 30``) only when asked for.

Prints markdown tables, writes the same rows as JSON (``--out``) and, for a full run of every
section, rewrites the generated part of docs/performance.md (``--doc``). ``--smoke`` runs tiny
sizes in about twenty seconds (tests/test_benchmarks_smoke.py; no timing is asserted).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import redis_server, report
from benchmarks.common import Row, machine_info
from benchmarks.throughput import Context

SECTIONS = (
    "throughput", "durability", "lookup", "ttft", "rss", "server", "signed", "scale", "peers",
    "growth", "quant", "restore", "agents", "agents_servers",
)  # fmt: skip
# run only when named in --only (not part of a full run): the soak takes --minutes
ON_REQUEST = ("soak",)
DEFAULT_DOC = "docs/performance.md"
DEFAULT_OUT = "benchmarks/results/latest.json"
VLLM_MLX_NOTE = (
    "vllm-mlx's caches are not measured in-process here: vllm-mlx 0.6.0 requires mlx-lm<0.32, "
    "while this benchmark and mlxcache's tests run mlx-lm 0.32, and it pulls torch/torchvision, "
    "gradio and opencv; its server is measured in the server section, in a venv of its own "
    "(benchmarks/vllm_server.py, .venv-vllm)."
)


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        msg = f"expected comma-separated integers, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError("sizes must be positive integers")
    return values


def _sections(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in SECTIONS + ON_REQUEST]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown section(s) {', '.join(bad) or '(none)'}; choose from "
            f"{', '.join(SECTIONS + ON_REQUEST)}"
        )
    return names


def _names(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected comma-separated names")
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    p.add_argument("--sizes", type=_ints, default=None, help="KV cache sizes in tokens")
    p.add_argument("--repeat", type=int, default=None, help="timed runs per measurement")
    p.add_argument(
        "--only",
        type=_sections,
        default=list(SECTIONS),
        help=",".join(SECTIONS) + " (default: all of them); " + ",".join(ON_REQUEST),
    )
    p.add_argument("--smoke", action="store_true", help="tiny sizes, about 10 seconds")
    p.add_argument(
        "--minutes",
        type=float,
        default=30.0,
        help="length of the soak (--only soak; not part of a full run), default 30",
    )
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON output path")
    p.add_argument(
        "--lookup-blocks",
        type=int,
        default=None,
        help="blocks stored for the memory:// and redis:// prefix lookups (default 100000)",
    )
    p.add_argument(
        "--lookup-blocks-disk",
        type=int,
        default=None,
        help="blocks stored for the file:// prefix lookup (default 100000, by put_many batches)",
    )
    p.add_argument("--prompt-lengths", type=_ints, default=None, help="TTFT prompt lengths")
    p.add_argument(
        "--peer-lengths", type=_ints, default=None, help="APC vs PrefixCache prompt lengths"
    )
    p.add_argument(
        "--growth-blocks",
        type=_ints,
        default=None,
        help="stored-block counts of the lookup growth curve (default 1000,10000,100000,1000000)",
    )
    p.add_argument(
        "--growth-budget",
        type=float,
        default=None,
        help="seconds each backend may spend filling the growth curve's store (default 150)",
    )
    p.add_argument(
        "--restore-lengths",
        type=_ints,
        default=None,
        help="prompt lengths of the restore curve (default 1024,2048,4096,8192,16384,32768)",
    )
    p.add_argument(
        "--restore-max-gb",
        type=float,
        default=None,
        help="skip restore points whose KV is larger than this (default 2)",
    )
    p.add_argument(
        "--restore-tokens",
        type=_ints,
        default=None,
        help="prompt lengths of the restore-for-another-worker rows (default 2048,8192,32768)",
    )
    p.add_argument(
        "--quant-lengths",
        type=_ints,
        default=None,
        help="prompt lengths of the quantized-KV rows (default 1024,4096)",
    )
    p.add_argument(
        "--doc",
        default=None,
        help=f"markdown file whose generated section is rewritten (default {DEFAULT_DOC} for a "
        "full run of every section, none otherwise; 'none' to skip)",
    )
    p.add_argument(
        "--engines",
        type=_names,
        default=None,
        help="agents_servers: only the engines whose name holds one of these (comma-separated: "
        "mlx-lm, mlx-vlm, vllm-mlx --continuous-batching, vllm-mlx default mode; default all)",
    )
    p.add_argument("--no-redis", action="store_true", help="skip everything that needs Redis")
    p.add_argument("--tmpdir", default=None, help="scratch folder (default: system temp)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    smoke = args.smoke
    sizes = args.sizes or ([32, 64] if smoke else [512, 4096, 16384])
    repeat = args.repeat or (2 if smoke else 5)
    lookup_blocks = args.lookup_blocks or (2000 if smoke else 100_000)
    lookup_disk = args.lookup_blocks_disk or (100 if smoke else 100_000)
    prompt_lengths = args.prompt_lengths or ([32, 64] if smoke else [128, 512, 2048])
    rss_sizes = sizes[:1] if smoke else sizes
    # prompt lengths that are not multiples of APC's 16-token blocks, plus one that is (256)
    peer_lengths = args.peer_lengths or ([40] if smoke else [250, 256, 1000])
    growth_blocks = args.growth_blocks or (
        [100, 300] if smoke else [1000, 10_000, 100_000, 1_000_000]
    )
    growth_budget = args.growth_budget or (20.0 if smoke else 150.0)
    restore_lengths = args.restore_lengths or (
        [64, 128] if smoke else [1024, 2048, 4096, 8192, 16384, 32768]
    )
    restore_max_gb = args.restore_max_gb or (0.1 if smoke else 2.0)
    quant_lengths = args.quant_lengths or ([64] if smoke else [1024, 4096])
    restore_tokens = args.restore_tokens or ([512] if smoke else [2048, 8192, 32768])
    scale_sizes = sizes[:1] if smoke else [n for n in (512, 4096) if n in sizes] or sizes[:2]

    scratch = Path(tempfile.mkdtemp(prefix="mlxcache-bench-", dir=args.tmpdir))
    ctx = Context(repeat=repeat, tmpdir=scratch, smoke=smoke)
    server: redis_server.RedisServer | None = None
    rows: list[Row] = []
    started = time.perf_counter()
    try:
        if not args.no_redis and redis_server.available():
            server = redis_server.RedisServer().start()
            ctx.redis_url = server.url
        elif not args.no_redis:
            ctx.note("redis-server is not installed: every Redis row is left out.")

        def _section(section: str) -> list[Row]:
            """The rows of one section."""
            out: list[Row] = []

            if section == "throughput":
                from benchmarks import throughput

                out += throughput.run(sizes, ctx)
            elif section == "durability":
                from benchmarks import durability

                out += durability.run(ctx)
            elif section == "lookup":
                from benchmarks import prefix_lookup

                out += prefix_lookup.run(lookup_blocks, lookup_disk, ctx)
            elif section == "ttft":
                from benchmarks import ttft

                out += ttft.run(prompt_lengths, ctx)
            elif section == "rss":
                from benchmarks import rss

                out += rss.run(rss_sizes, ctx)
            elif section == "server":
                from benchmarks import lm_server, vllm_server, vlm_server

                out += lm_server.run(ctx)
                out += vlm_server.run(ctx)
                out += vllm_server.run(ctx)
            elif section == "peers":
                from benchmarks import peers_lm, peers_vlm

                out += peers_vlm.run(peer_lengths, ctx)
                out += peers_lm.run(256 if smoke else 2048, ctx)
                ctx.note(VLLM_MLX_NOTE)
            elif section == "growth":
                from benchmarks import growth

                out += growth.run(
                    growth_blocks, restore_lengths, growth_budget, restore_max_gb, ctx
                )
            elif section == "signed":
                from benchmarks import signed

                out += signed.run(sizes[-1:], ctx)
            elif section == "quant":
                from benchmarks import quant

                out += quant.run(quant_lengths, ctx)
            elif section == "restore":
                from benchmarks import restore

                out += restore.run(restore_tokens, ctx)
            elif section == "agents":
                from benchmarks import agents

                out += agents.run(ctx)
            elif section == "agents_servers":
                from benchmarks import agents_servers

                out += agents_servers.run(ctx, args.engines)
            elif section == "soak":
                from benchmarks import soak

                out += soak.run(ctx, args.minutes)
            elif section == "scale":
                from benchmarks import scale

                out += scale.run(scale_sizes, ctx)
            return out

        for section in args.only:
            t0 = time.perf_counter()
            try:
                rows += _section(section)
            except Exception as e:  # one broken section must not lose the others' rows
                import traceback

                traceback.print_exc()
                ctx.note(f"section {section} failed and is left out: {type(e).__name__}: {e}")
            print(f"[{section}: {time.perf_counter() - t0:.1f} s]", file=sys.stderr)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(scratch, ignore_errors=True)

    config = {
        "sizes": sizes,
        "repeat": repeat,
        "sections": args.only,
        "smoke": smoke,
        "lookup_blocks": lookup_blocks,
        "lookup_blocks_disk": lookup_disk,
        "prompt_lengths": prompt_lengths,
        "rss_sizes": rss_sizes,
        "peer_lengths": peer_lengths,
        "growth_blocks": growth_blocks,
        "growth_budget": growth_budget,
        "restore_lengths": restore_lengths,
        "restore_max_gb": restore_max_gb,
        "scale_sizes": scale_sizes,
        "quant_lengths": quant_lengths,
        "restore_tokens": restore_tokens,
        "engines": args.engines,
        "seconds": round(time.perf_counter() - started, 1),
        "command": "python -m benchmarks " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    machine = machine_info()
    print(f"Machine: {report.machine_line(machine)}\n")
    print(report.markdown(rows, ctx.notes))
    report.write_json(args.out, report.document(rows, machine, config, ctx.notes))
    print(f"wrote {args.out} ({config['seconds']} s)", file=sys.stderr)
    doc = args.doc
    if doc is None and not smoke and list(args.only) == list(SECTIONS) and not args.engines:
        doc = DEFAULT_DOC
    if doc and doc != "none":
        from benchmarks import docgen

        docgen.update(doc, rows, machine, config, ctx.notes)
        print(f"rewrote the generated section of {doc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
