"""``python -m benchmarks``: throughput, prefix lookup, TTFT and peak memory, in one run.

Prints a markdown table and writes the same rows as JSON (``--out``). ``--smoke`` runs tiny
sizes in about ten seconds (used by tests/test_benchmarks_smoke.py; no timing is asserted).
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

SECTIONS = ("throughput", "lookup", "ttft", "rss", "server", "signed", "scale")
DEFAULT_OUT = "benchmarks/results/latest.json"


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
    bad = [n for n in names if n not in SECTIONS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown section(s) {', '.join(bad) or '(none)'}; choose from {', '.join(SECTIONS)}"
        )
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    p.add_argument("--sizes", type=_ints, default=None, help="KV cache sizes in tokens")
    p.add_argument("--repeat", type=int, default=None, help="timed runs per measurement")
    p.add_argument("--only", type=_sections, default=list(SECTIONS), help=",".join(SECTIONS))
    p.add_argument("--smoke", action="store_true", help="tiny sizes, about 10 seconds")
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
        help="blocks stored for the file:// prefix lookup (default 2000: each put fsyncs)",
    )
    p.add_argument("--prompt-lengths", type=_ints, default=None, help="TTFT prompt lengths")
    p.add_argument("--no-redis", action="store_true", help="skip everything that needs Redis")
    p.add_argument("--tmpdir", default=None, help="scratch folder (default: system temp)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    smoke = args.smoke
    sizes = args.sizes or ([32, 64] if smoke else [512, 4096, 16384])
    repeat = args.repeat or (2 if smoke else 5)
    lookup_blocks = args.lookup_blocks or (2000 if smoke else 100_000)
    lookup_disk = args.lookup_blocks_disk or (100 if smoke else 2000)
    prompt_lengths = args.prompt_lengths or ([32, 64] if smoke else [128, 512, 2048])
    rss_sizes = sizes[:1] if smoke else sizes
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
        for section in args.only:
            t0 = time.perf_counter()
            if section == "throughput":
                from benchmarks import throughput

                rows += throughput.run(sizes, ctx)
            elif section == "lookup":
                from benchmarks import prefix_lookup

                rows += prefix_lookup.run(lookup_blocks, lookup_disk, ctx)
            elif section == "ttft":
                from benchmarks import ttft

                rows += ttft.run(prompt_lengths, ctx)
            elif section == "rss":
                from benchmarks import rss

                rows += rss.run(rss_sizes, ctx)
            elif section == "server":
                from benchmarks import lm_server

                rows += lm_server.run(ctx)
            elif section == "signed":
                from benchmarks import signed

                rows += signed.run(sizes[-1:], ctx)
            elif section == "scale":
                from benchmarks import scale

                rows += scale.run(scale_sizes, ctx)
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
        "scale_sizes": scale_sizes,
        "seconds": round(time.perf_counter() - started, 1),
        "command": "python -m benchmarks " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    machine = machine_info()
    print(f"Machine: {report.machine_line(machine)}\n")
    print(report.markdown(rows, ctx.notes))
    report.write_json(args.out, report.document(rows, machine, config, ctx.notes))
    print(f"wrote {args.out} ({config['seconds']} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
