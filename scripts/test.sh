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
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'

.venv/bin/ruff format --check mlxcache tests benchmarks
.venv/bin/ruff check mlxcache tests benchmarks
.venv/bin/mypy
bash scripts/package_smoke.sh
# the vllm-mlx server tests run their servers in a venv of their own (vllm-mlx 0.6 pins
# mlx-lm < 0.32): built once (about 2 minutes, 1.1 GB), kept while its recipe is unchanged
PYTHON="$PYTHON" bash scripts/vllm_venv.sh .venv-vllm
exec .venv/bin/python -m pytest "$@"
