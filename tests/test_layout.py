"""The house rules of the package's layout: parts as subpackages, imports only run down, small
modules, every documented import path importable, type information shipped."""

from __future__ import annotations

import ast
import importlib
import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mlxcache"

# the parts from the top down (docs/design.md's map); a module may import its own part or lower
RANKS = {
    "mlxcache": 9,  # the package face: re-exports only
    "mlxcache.__main__": 9,
    "mlxcache.mllm_cache": 9,  # vllm-mlx import paths
    "mlxcache.vision_embedding_cache": 9,
    "mlxcache.cli": 8,
    "mlxcache.integrations": 7,
    "mlxcache.prefix": 6,
    "mlxcache.metrics": 5,
    "mlxcache.backends": 4,
    "mlxcache.uri": 3,
    "mlxcache.serializers": 3,
    "mlxcache.protocol": 2,
    "mlxcache.records": 1,
    "mlxcache.errors": 0,
    "mlxcache.options": 0,
    "mlxcache.hashing": 0,
    "mlxcache.buffers": -1,  # below everything: one typed memoryview of an mx.array
    "mlxcache.tiny_models": 0,
}


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def part_of(name: str) -> str:
    best = max((p for p in RANKS if name == p or name.startswith(p + ".")), key=len)
    return best


def imports_of(path: Path, name: str) -> set[str]:
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("mlxcache")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            if base.startswith("mlxcache"):  # a name, or a submodule, of ``base``
                found |= {f"{base}.{a.name}" for a in node.names}
    return found


def test_imports_only_run_down_the_parts():
    known = modules()
    upward = []
    for name, path in known.items():
        here = part_of(name)
        for target in imports_of(path, name):
            while target not in known and "." in target:  # `from pkg import name`
                target = target.rpartition(".")[0]
            there = part_of(target)
            if there != here and RANKS[there] >= RANKS[here]:
                upward.append(f"{name} -> {target}")
    assert upward == []


def test_no_import_cycles_between_modules():
    known = modules()
    graph = {}
    for name, path in known.items():
        targets = set()
        for target in imports_of(path, name):
            while target not in known and "." in target:
                target = target.rpartition(".")[0]
            if target != name and not name.startswith(target + "."):  # a package's own face
                targets.add(target)
        graph[name] = targets - {"mlxcache"}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                raise AssertionError(" -> ".join([*trail, node, nxt]))
            if nxt not in state:
                visit(nxt, [*trail, node])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def test_modules_are_small_and_parts_are_folders():
    sizes = {p: len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert [str(p) for p, n in sizes.items() if n > 500] == []
    families = Counter((p.parent, p.stem.split("_")[0]) for p in sizes if "_" in p.stem.strip("_"))
    assert [f"{d}/{k}_*" for (d, k), n in families.items() if n >= 3] == []
    top = [p.name for p in PACKAGE.glob("*.py")]
    assert len(top) <= 12, top


def documented_paths() -> set[str]:
    text = (ROOT / "README.md").read_text() + "".join(
        p.read_text() for p in (ROOT / "docs").glob("*.md")
    )
    # (a file name in a path, docs/grafana/mlxcache.json, is not an import path)
    return set(re.findall(r"(?<![/\w])mlxcache(?:\.[A-Za-z_][A-Za-z0-9_]*)+", text))


def test_documented_import_paths_resolve():
    missing = []
    for dotted in sorted(documented_paths()):
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ModuleNotFoundError:
                continue
            try:
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                missing.append(dotted)
            break
        else:
            missing.append(dotted)
    assert missing == []


@pytest.mark.parametrize(
    "path, names",
    [
        ("mlxcache", ["PrefixCache", "PrefixHit", "Record", "CacheBackend", "open_backend"]),
        ("mlxcache.mllm_cache", ["MLLMPrefixCacheManager", "compute_image_hash"]),
        ("mlxcache.vision_embedding_cache", ["VisionEmbeddingCache"]),
        ("mlxcache.serializers", ["dump_prompt_cache", "load_prompt_cache", "cache_nbytes"]),
        ("mlxcache.integrations.mlx_lm", ["cached_generate", "prefill", "generate_tokens"]),
        ("mlxcache.integrations.mlx_vlm", ["cached_generate", "prefill", "generate_tokens"]),
        ("mlxcache.backends.memory", ["MemoryBackend"]),
        ("mlxcache.backends.disk", ["DiskBackend"]),
        ("mlxcache.backends.redis", ["RedisBackend", "ClusterRouter", "SentinelRouter"]),
        ("mlxcache.backends.tiered", ["TieredBackend"]),
        ("mlxcache.backends.base", ["BackendBase", "CacheBackend"]),
        ("mlxcache.cli", ["main"]),
    ],
)
def test_public_names_import_from_their_documented_paths(path, names):
    module = importlib.import_module(path)
    assert [n for n in names if not hasattr(module, n)] == []


def test_the_package_ships_its_type_information():
    assert (PACKAGE / "py.typed").exists()
