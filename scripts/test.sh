#!/usr/bin/env bash
# Install everything the tests need (redis-server, a fresh .venv with mlxcache[test]) and run
# lint, the type checker, the package smoke run (wheel + sdist, the wheel in a clean venv) and the
# whole test suite. The README's test command and .ci/run both call this.
set -euo pipefail
cd "$(dirname "$0")/.."

# redis-cli builds the test Redis Cluster; sentinels run as `redis-server --sentinel`
if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools >/dev/null
  elif command -v brew >/dev/null 2>&1; then
    brew install redis
  else
    echo "redis-server or redis-cli is missing: install them (apt-get install redis-server redis-tools / brew install redis)" >&2
    exit 1
  fi
fi

PYTHON=${PYTHON:-python3}
# the vllm-mlx server tests run their servers in a venv of their own (vllm-mlx 0.6 pins
# mlx-lm < 0.32): its dependencies install in the background while the main venv, lint and the
# package smoke run (about 2 minutes, 1.1 GB, kept while its recipe is unchanged)
vllm_log=$(mktemp)
PYTHON="$PYTHON" bash scripts/vllm_venv.sh .venv-vllm deps >"$vllm_log" 2>&1 &
vllm_deps=$!
trap 'kill "$vllm_deps" 2>/dev/null || true; rm -f "$vllm_log"' EXIT

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'

.venv/bin/ruff format --check mlxcache tests benchmarks
.venv/bin/ruff check mlxcache tests benchmarks
.venv/bin/mypy
bash scripts/package_smoke.sh
if ! wait "$vllm_deps"; then
  cat "$vllm_log" >&2
  echo "building .venv-vllm failed (scripts/vllm_venv.sh)" >&2
  exit 1
fi
PYTHON="$PYTHON" bash scripts/vllm_venv.sh .venv-vllm  # adds mlxcache itself
# two workers, each taking whole test files (module fixtures such as a file's servers stay in
# one process); PYTEST_WORKERS=0 runs in one process
.venv/bin/python -m pytest -n "${PYTEST_WORKERS:-2}" --dist loadfile "$@"
