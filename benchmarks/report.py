"""Markdown tables and the JSON document, both built from the same rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.common import Row, human_bytes, human_time

TITLES = {
    "throughput": "Put / get throughput (ratio = baseline time / our time, > 1 = faster)",
    "durability": "file:// put under each sync setting (ratio = sync=always / this, > 1 = faster)",
    "lookup": "Prefix lookup latency",
    "ttft": "Time to first token: uncached, cold, warm, another worker, after a restart",
    "scale": "Background stores, tiers, Redis Cluster (ratio = baseline / ours, > 1 = faster)",
    "quant": "Quantized KV storage (ratio = exact / quantized, > 1 = quantized wins)",
    "rss": "Peak extra memory during put / get (ratio = extra RSS / payload, lower is better)",
}


def _value(row: Row, v: float) -> str:
    if row.unit == "s":
        return human_time(v)
    if row.unit == "x":
        return f"{v:.2f}x"
    if row.unit == "tokens":  # a break-even: "never", or "< N" when only a bound is known
        if v == float("inf"):
            return "never"
        return ("< " if row.extra.get("bound") == "below" else "") + f"{v:,.0f} tokens"
    return f"{v:.3g} {row.unit}".strip()


def _size(row: Row) -> str:
    parts = []
    if row.tokens is not None:
        parts.append(f"{row.tokens} tok")
    if row.extra.get("blocks"):
        parts.append(f"{row.extra['blocks']} blocks")
    if row.nbytes:
        parts.append(human_bytes(row.nbytes))
    return ", ".join(parts)


def markdown(rows: list[Row], notes: list[str] | None = None) -> str:
    """One table per section, in the order the sections ran."""
    out: list[str] = []
    sections: list[str] = []
    for r in rows:
        if r.section not in sections:
            sections.append(r.section)
    for section in sections:
        out.append(f"### {TITLES.get(section, section)}\n")
        out.append(
            "| op | size | median | spread (min–max) | GB/s | baseline | ratio | target | met |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            if r.section != section:
                continue
            st = r.stats
            med = _value(r, st.median) if st else ""
            spread = f"{_value(r, st.min)} – {_value(r, st.max)}" if st else ""
            gbps = f"{r.gbps:.2f}" if r.gbps is not None and section == "throughput" else ""
            ratio = f"{r.ratio:.2f}x" if r.ratio is not None and r.unit != "x" else ""
            met = {True: "yes", False: "**no**", None: ""}[r.met]
            name = f"{r.name} ({r.note})" if r.note else r.name
            base = r.baseline or ("*(limit)*" if r.ratio_kind == "limit" else "")
            out.append(
                f"| {name} | {_size(r)} | {med} | {spread} | {gbps} | {base} | {ratio} "
                f"| {r.target or ''} | {met} |"
            )
        out.append("")
    if notes:
        out.append("Notes:\n")
        out.extend(f"- {n}" for n in notes)
        out.append("")
    return "\n".join(out)


def document(
    rows: list[Row], machine: dict[str, Any], config: dict[str, Any], notes: list[str]
) -> dict[str, Any]:
    return {
        "machine": machine,
        "config": config,
        "notes": notes,
        "rows": [r.to_json() for r in rows],
    }


def write_json(path: str | Path, doc: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    tmp.replace(path)


def machine_line(m: dict[str, Any]) -> str:
    return (
        f"{m.get('cpu', '?')}, {m.get('nproc')} cores, {m.get('mem_gib')} GiB, "
        f"{m.get('platform')}, Python {m.get('python')}, mlx {m.get('mlx')} "
        f"({m.get('mlx_device')}), mlx-lm {m.get('mlx_lm')}, mlx-vlm {m.get('mlx_vlm')}, "
        f"redis-py {m.get('redis')} (hiredis: {m.get('hiredis')})"
    )
