"""The table that opens docs/performance.md: how much faster a repeated request is.

Per generation path and prompt length (the ``ttft`` section) and per server (the ``server``
section, where its rows exist): the time to first token uncached, on a miss (cold), warm in the
same process, from another worker and after a restart, each with its speed-up over uncached.
"""

from __future__ import annotations

from benchmarks.common import Row, human_time
from benchmarks.ttft import KINDS

HEADER = (
    "| engine (model) | prompt | uncached | cold: a miss | warm, same process "
    "| another worker | after a restart |"
)

# server rows: (engine label, {kind: row name}); a kind the run did not measure stays blank
VLLM = ("text, --continuous-batching", "image, --mllm simple mode")
SERVERS: list[tuple[str, dict[str, str]]] = [
    (
        "`mlxcache serve` (mlx-lm engine)",
        {
            "uncached": "mlx_lm.server cold",
            "warm": "mlxcache serve warm, same process",
            "restart": "mlxcache serve warm, new process (file://)",
        },
    ),
    (
        "`mlxcache serve --engine mlx-vlm`",
        {
            "uncached": "mlx_vlm.server APC cold",
            "cold": "mlxcache serve --engine mlx-vlm cold",
            "warm": "mlxcache serve --engine mlx-vlm warm, same process",
            "worker": "mlxcache serve --engine mlx-vlm warm, second live server",
        },
    ),
] + [
    (
        f"`mlxcache serve --engine vllm-mlx` ({what})",
        {
            "uncached": f"vllm-mlx serve ({what}) cold",
            "cold": f"mlxcache serve --engine vllm-mlx ({what}) cold",
            "warm": f"mlxcache serve --engine vllm-mlx ({what}) warm, same process",
            "worker": f"mlxcache serve --engine vllm-mlx ({what}) warm, second live server",
            "restart": f"mlxcache serve --engine vllm-mlx ({what}) after a restart (SIGKILL)",
        },
    )
    for what in VLLM
]
MODELS = {"qwen2_vl": "tiny Qwen2-VL", "gemma3": "tiny Gemma 3", "llama": "tiny llama"}


def _cell(kind: str, t: float | None, plain: float | None) -> str:
    if t is None:
        return ""
    if plain is None or kind == "uncached":
        return human_time(t)
    if kind == "cold":
        return f"{human_time(t)} ({(t / plain - 1) * 100:+.0f}%)"
    return f"{human_time(t)} (**{plain / t:.0f}x**)"


def _line(label: str, tokens: int | None, times: dict[str, float]) -> str:
    plain = times.get("uncached")
    cells = [_cell(k, times.get(k), plain) for k in KINDS]
    return f"| {label} | {tokens or ''} | " + " | ".join(cells) + " |"


def ttft_series(rows: list[Row]) -> dict[tuple[str, str], dict[int, dict[str, float]]]:
    """(engine, family) -> prompt length -> kind -> median seconds, from the ttft rows."""
    out: dict[tuple[str, str], dict[int, dict[str, float]]] = {}
    for r in rows:
        if r.section != "ttft" or r.stats is None or "kind" not in r.extra:
            continue
        if r.extra["kind"] != "uncached" and r.extra.get("backend") != "file://":
            continue
        key = (r.extra["engine"], r.extra["family"])
        out.setdefault(key, {}).setdefault(r.tokens or 0, {})[r.extra["kind"]] = r.stats.median
    return out


def table(rows: list[Row]) -> str:
    """The opening table; "" when the run has neither ttft nor server rows."""
    lines = []
    for (engine, family), by_length in ttft_series(rows).items():
        for n in sorted(by_length):
            lines.append(_line(f"{engine} ({MODELS.get(family, family)})", n, by_length[n]))
    for label, names in SERVERS:
        found = {
            k: r for k, name in names.items() for r in rows if r.section == "server"
            and r.name == name and r.stats is not None
        }  # fmt: skip
        if not found.get("warm"):
            continue
        times = {k: r.stats.median for k, r in found.items() if r.stats is not None}
        lines.append(_line(label, found["warm"].tokens, times))
    if not lines:
        return ""
    sep = "|---|---|" + "---|" * len(KINDS)
    return "\n".join([HEADER, sep, *lines])
