#!/usr/bin/env bash
# The package as users get it: build the wheel and sdist, install the wheel into a clean venv
# and use it from outside the source tree, so a file left out of the package fails here.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
.venv/bin/python -m build --outdir "$out/dist" . >"$out/build.log" 2>&1 || { cat "$out/build.log"; exit 1; }
ls "$out"/dist/mlxcache-*.tar.gz >/dev/null
"$PYTHON" -m venv "$out/venv"
"$out/venv/bin/python" -m pip install -q "$out"/dist/mlxcache-*.whl
cd "$out"
"$out/venv/bin/mlxcache" --version
"$out/venv/bin/python" - <<'PY'
import importlib.resources as resources
import mlxcache
from mlxcache.tiny_models import build_model  # noqa: F401 - the tiny-model code ships too

root = resources.files("mlxcache")
assert "site-packages" in str(root), f"imported from the source tree: {root}"
assert (root / "py.typed").is_file(), "py.typed is missing from the wheel"
configs = sorted(p.name for p in (root / "data" / "tiny_models").iterdir())
assert "qwen2_vl.json" in configs, configs
print(f"package smoke: mlxcache {mlxcache.__version__} from {root}, py.typed, {len(configs)} tiny-model files")
PY
