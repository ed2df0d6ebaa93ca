"""docs/grafana/mlxcache.json queries only metrics that mlxcache exports.

The metric names and labels of every panel's PromQL are checked against what a real
``mlxcache serve`` answers on ``/metrics`` (over a real redis-server, after a real request) and
what ``mlxcache.metrics.render`` gives for real file:// and memory:// backends.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from redis_server import RedisServer
from serve_fleet import ENGINES, start_workers

from mlxcache import open_backend
from mlxcache.metrics import render

DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana" / "mlxcache.json"
NAME = re.compile(r"\bmlxcache_[a-z_]+")
BY = re.compile(r"\b(?:by|without) \(([^)]*)\)")
SELECTOR = re.compile(r"\{([^}]*)\}")


def queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]]


def samples(text: str) -> dict[str, set[str]]:
    """Sample name -> the label names it carries."""
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out


def labels_of(expr: str) -> set[str]:
    names = {n.strip() for group in BY.findall(expr) for n in group.split(",") if n.strip()}
    for group in SELECTOR.findall(expr):
        names |= {m.split("=")[0].strip(" !~") for m in group.split(",") if m.strip()}
    return names


def check(exported: dict[str, set[str]], names: set[str]) -> None:
    missing = sorted(n for n in names if n not in exported)
    assert not missing, f"the dashboard queries metrics nothing exports: {missing}"


def test_the_dashboard_is_a_grafana_dashboard_with_a_prometheus_datasource():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) >= 8
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    for p in dashboard["panels"]:
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("hit ratio", "tokens reused", "budget", "evictions", "errors", "rejected",
                  "lookup", "store", "prefix lookup latency", "prefix store latency",
                  "engine server"):  # fmt: skip
        assert topic in titles, topic


def test_every_queried_metric_is_exported_by_a_real_serve(tmp_path):
    engine = ENGINES["mlx-lm"]
    model = engine.build(tmp_path)
    with RedisServer() as redis:
        uri, no_hot_tier = redis.url + "?max_bytes=64m", ("--prompt-cache-bytes", "1")
        (worker,) = start_workers(engine, model, uri, tmp_path, n=1, flags=no_hot_tier)
        try:
            worker.chat(engine.messages(0), 2)  # a PrefixCache exists once a request came
            worker.chat(engine.messages(0), 2)  # a hit: from Redis, with no hot tier
            import urllib.request

            with urllib.request.urlopen(worker.url + "/metrics", timeout=10) as r:
                exported = samples(r.read().decode())
        finally:
            worker.kill()
    names = {n for q in queries() for n in NAME.findall(q)}
    assert len(names) >= 19
    check(exported, names)
    for q in queries():  # and every label it groups or filters by is on those samples
        carried = set.union(*(exported[n] for n in NAME.findall(q)))
        assert labels_of(q) <= carried | {"le"}, (q, carried)


@pytest.mark.parametrize("uri", ["file://{tmp}/cache?max_bytes=1m", "memory://?max_bytes=1m"])
def test_every_backend_metric_is_rendered_for_each_backend(uri, tmp_path):
    import mlx.core as mx

    from mlxcache import Record

    with open_backend(uri.format(tmp=tmp_path)) as backend:
        backend.put("k", Record(arrays={"a": mx.zeros((4,))}))
        backend.get("k")
        exported = samples(render(backend).decode())
    backend_names = {
        n
        for q in queries()
        for n in NAME.findall(q)
        if not n.startswith(("mlxcache_prefix_", "mlxcache_serve_"))
    }
    if uri.startswith("memory"):  # one process' memory: no store-wide fleet counters
        backend_names = {n for n in backend_names if "_fleet_" not in n}
    check(exported, backend_names)
