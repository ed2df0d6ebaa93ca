"""The benchmark's smoke mode runs end to end and writes well-formed rows (no timing asserted)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOOKUPS = ("hit", "partial", "miss")  # the prefix lookups benchmarks/prefix_lookup.py times
AGENT_WORKERS = (
    "mlxcache, one worker",
    "mlxcache, two workers",
    "mlx-lm LRUPromptCache, one worker",
    "mlx-lm LRUPromptCache, two workers",
)


def _importable(module: str) -> bool:
    code = f"import {module}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return (
        subprocess.run([sys.executable, "-c", code], env=env, capture_output=True).returncode == 0
    )


def test_smoke_run_writes_expected_rows(tmp_path: Path) -> None:
    out = tmp_path / "latest.json"
    doc_before = (ROOT / "docs" / "performance.md").read_bytes()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--smoke", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "| op |" in done.stdout  # the markdown table is printed
    assert (ROOT / "docs" / "performance.md").read_bytes() == doc_before  # smoke: docs untouched

    doc = json.loads(out.read_text())
    assert doc["config"]["smoke"] is True
    assert doc["machine"]["nproc"] >= 1
    rows = doc["rows"]
    names = {(r["section"], r["name"]) for r in rows}
    by_name = {(r["section"], r["name"]): r for r in rows}

    expected = {
        ("throughput", "numpy memcpy"),
        ("throughput", "mx.save_safetensors + fsync"),
        ("throughput", "mx.load + eval"),
        ("throughput", "raw write + fsync (dd)"),
        ("throughput", "raw read (page cache)"),
        ("throughput", "pickle.dumps (numpy views)"),
        ("throughput", "pickle.loads"),
        ("throughput", "memory:// put"),
        ("throughput", "memory:// get + eval"),
        ("throughput", "safetensors.to_bytes"),
        ("throughput", "safetensors.from_bytes"),
        ("rss", "memory:// put"),
        ("rss", "memory:// get"),
    }
    if _importable("mlx_lm"):
        expected |= {
            ("throughput", "mlx-lm save_prompt_cache"),
            ("throughput", "mlx-lm load_prompt_cache + eval"),
        }
    if _importable("mlxcache.backends.disk"):
        expected |= {
            ("throughput", "file:// put"),
            ("throughput", "file:// get"),
            ("throughput", "file:// put, cold allocator"),
            ("throughput", "file:// get, cold allocator"),
            ("throughput", "mx.load + eval, cold allocator"),
            ("throughput", "mx.save_safetensors + fsync, cold allocator"),
            ("rss", "file:// put"),
            ("rss", "file:// get"),
            ("durability", "file:// put_many, 32 tiny blocks, sync=batch"),
            ("durability", "file:// put, one KV record, sync=never"),
            ("lookup", "file:// lookup (hit)"),
        }
    if _importable("mlxcache.prefix"):
        expected |= {("lookup", "memory:// lookup (hit)"), ("lookup", "memory:// lookup (miss)")}
    if shutil.which("redis-server"):
        expected |= {("throughput", "redis-py SET (raw)"), ("throughput", "redis-py GET (raw)")}
        if _importable("mlxcache.backends.redis"):
            expected |= {("throughput", "redis:// put"), ("throughput", "redis:// get")}
            if _importable("mlxcache.prefix"):
                expected |= {("lookup", f"redis:// lookup ({k})") for k in LOOKUPS}
    if _importable("mlxcache.integrations.mlx_vlm") and _importable("mlxcache.backends.disk"):
        expected |= {("ttft", "qwen2_vl uncached"), ("ttft", "qwen2_vl file:// warm")}
        expected |= {
            ("ttft", f"qwen2_vl file:// {k}") for k in ("another worker", "after a restart")
        }
    if _importable("mlxcache.integrations.mlx_lm") and _importable("mlxcache.backends.disk"):
        expected |= {("ttft", "llama file:// cold"), ("ttft", "llama file:// after a restart")}
    if _importable("mlx_lm") and _importable("mlxcache.integrations.mlx_lm.server"):
        expected |= {
            ("server", "mlx_lm.server warm, same process"),
            ("server", "mlxcache serve warm, new process (file://)"),
        }
    if _importable("mlx_vlm.apc") and _importable("mlxcache.integrations.mlx_vlm"):
        expected |= {
            ("peers", "APC warm, same process"),
            ("peers", "APC warm, new process (disk)"),
            ("peers", "mlxcache memory:// warm, same process"),
            ("peers", "mlxcache file:// warm, new process"),
            ("peers", "APC flipped byte, new process"),
            ("peers", "mlxcache file:// flipped byte, new process"),
            ("peers", "APC bytes on disk per token"),
        }
    if _importable("mlxcache.integrations.mlx_lm.prompt_cache"):
        expected |= {
            ("peers", "mlx-lm LRUPromptCache fetch_nearest_cache"),
            ("peers", "SharedPromptCache (memory://) fetch_nearest_cache"),
            ("peers", "file:// get + load_prompt_cache + eval"),
        }
    if _importable("mlxcache.prefix"):
        expected |= {
            ("growth", "memory:// lookup (hit)"),
            ("growth", "restore Qwen2.5-7B memory://"),
            ("growth", "break-even Qwen2.5-7B memory:// vs M2 Max, 7B Q4_0"),
        }
    if _importable("mlxcache.prefix") and _importable("mlx_lm"):
        expected |= {
            ("quant", "q8 file:// restore"),
            ("quant", "q4 file:// store"),
            ("quant", "q8 file:// bytes per token"),
            ("quant", "q4 file:// restore: link cost at the tie"),
            ("quant", "qwen2_vl q8: max |logit diff| vs exact"),
            ("quant", "gemma3 q8: greedy tokens equal to uncached"),
        }
        if shutil.which("redis-server"):
            expected |= {("quant", "q8 redis:// restore"), ("quant", "q4 redis:// store")}
    agents = {}  # the agent workload's counts per family group (benchmarks/agents.py)
    if _importable("mlxcache.integrations.mlx_lm") and _importable("mlxcache.backends.disk"):
        for group in (
            "dense (glm)",
            "sliding (olmo3)",
            "chunked (llama4)",
            "recurrent (qwen3_5)",
        ):
            for who in AGENT_WORKERS:
                agents[group, who] = ("agents", f"{group}, chat: {who}")
        expected |= set(agents.values())
    expected |= {("signed", "signed file:// put"), ("signed", "signed file:// get")}
    expected |= {("signed", "keyed BLAKE3 (the MAC)"), ("signed", "signed from_bytes")}
    missing = expected - names
    assert not missing, f"rows missing: {sorted(missing)}; notes: {doc['notes']}"
    # the vllm-mlx server rows (twelve server starts) are left out of --smoke with one note
    assert not [r for r in rows if r["name"].startswith("vllm-mlx serve")]
    assert sum("vllm-mlx server TTFT rows" in n for n in doc["notes"]) == 1, doc["notes"]

    # every PrefixCache lookup on one Redis server is one round trip (the default path: 2-3)
    for row in rows:
        if row["section"] == "lookup" and row["name"].startswith("redis://"):
            assert row["extra"]["round_trips"] == 1 and row["met"], row
            assert row["extra"]["round_trips_default"] in (2, 3), row

    # agents: a second worker on the shared store reuses what the first does; two mlx-lm
    # servers (one LRU each) reuse less; block-granular layers reuse what a dense model does
    reused = {k: by_name[v]["stats"]["median"] for k, v in agents.items()}
    # each group's model makes that group's cache layers (llama4_text would make KVCache only)
    want = {"dense": "KVCache", "sliding": "RotatingKVCache", "chunked": "ChunkedKVCache",
            "recurrent": "ArraysCache"}  # fmt: skip
    for (group, _), name in agents.items():
        layers = by_name[name]["extra"]["cache_layers"]
        assert want[group.split()[0]] in layers, (group, layers)
    for group in {g for g, _ in agents}:
        one, two = reused[group, "mlxcache, one worker"], reused[group, "mlxcache, two workers"]
        assert one == two, (group, one, two)
        if not group.startswith("recurrent"):
            assert one == reused["dense (glm)", "mlxcache, one worker"], group
            assert two > reused[group, "mlx-lm LRUPromptCache, two workers"], group

    # a flipped byte on disk must never come back as a silent hit in our cache
    ours_flip = [r for r in rows if r["name"] == "mlxcache file:// flipped byte, new process"]
    assert all(r["met"] for r in ours_flip), ours_flip
    for row in rows:
        stats = row["stats"]
        assert stats is not None and stats["runs"] >= 1, row
        if row["name"].startswith("break-even"):  # "never" is infinite
            assert stats["median"] >= 0, row
            continue
        assert math.isfinite(stats["median"]) and stats["median"] >= 0, row
        assert stats["min"] <= stats["median"] <= stats["max"], row
        if row["ratio"] is not None:
            assert isinstance(row["ratio"], int | float), row
            if row["section"] in ("rss", "agents", "agents_servers"):
                assert row["ratio"] >= 0, row  # a put that copies nothing, nothing reused: 0
            else:
                assert math.isfinite(row["ratio"]) and row["ratio"] > 0, row
        if row["baseline"] and row["section"] == "throughput":
            assert any(r["name"] == row["baseline"] for r in rows), row

    # the docs' generated section is rebuilt from the same JSON, the hand-written text kept
    doc = tmp_path / "performance.md"
    doc.write_text(
        "# Perf\n\nkept above\n\n"
        "<!-- BEGIN GENERATED by `python -m benchmarks`: do not edit by hand -->\nstale\n"
        "<!-- END GENERATED -->\n\nkept below\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.docgen", str(out), str(doc)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    text = doc.read_text()
    assert "kept above" in text and "kept below" in text and "stale" not in text
    assert "### Headline" in text and "### Peers side by side" in text
    # the page opens with the TTFT table (per engine: uncached ... after a restart)
    assert text.index("### Time to first token") < text.index("### Headline")
    assert "| mlx-lm generation (tiny llama) |" in text
    even = [line for line in text.splitlines() if line.startswith("| break-even")]
    assert even and not [line for line in even if "| 0 tokens |" in line]  # "< N", a length
    assert text.count("<!-- BEGIN GENERATED") == 1 and text.count("<!-- END GENERATED -->") == 1


def test_agent_servers_smoke_a_second_server_reuses_the_shared_document(tmp_path: Path) -> None:
    """The agent workload over HTTP (benchmarks/agents_servers.py, --smoke: mlx-lm's servers on a
    sliding-window olmo3): two ``mlxcache serve`` on one store reuse the document one does, and
    more than two stock ``mlx_lm.server``s (whose count is what it is); answers are the stock's."""
    out = tmp_path / "servers.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--only", "agents_servers", "--smoke", "--out",
         str(out), "--tmpdir", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    doc = json.loads(out.read_text())
    rows = {r["name"]: r for r in doc["rows"] if r["section"] == "agents_servers"}
    sides = ("mlx_lm.server, one server", "mlx_lm.server, two servers",
             "mlxcache serve, one server", "mlxcache serve, two servers")  # fmt: skip
    names = {f"mlx-lm, sliding (olmo3), {k}: {s}" for k in ("chat", "document") for s in sides}
    assert set(rows) == names, doc["notes"]
    reused = {name: row["stats"]["median"] for name, row in rows.items()}
    for name, row in rows.items():
        assert row["extra"]["prompt_mismatch"] == 0, row  # our token count is the server's
        assert 0 <= reused[name] <= row["tokens"], row
        if ": mlxcache" in name:
            assert row["extra"]["equal_answers"] == row["extra"]["requests"], row
    doc_ = "mlx-lm, sliding (olmo3), document: "
    one, two = reused[doc_ + sides[2]], reused[doc_ + sides[3]]
    block, questions = 32, 3
    reusable = rows[doc_ + sides[3]]["tokens"]
    # every question after the first: the shared document's blocks, from either server
    assert one == two >= reusable - questions * block > 0
    assert two > reused[doc_ + sides[1]]
    chat = "mlx-lm, sliding (olmo3), chat: "
    assert reused[chat + sides[3]] >= reused[chat + sides[1]]
