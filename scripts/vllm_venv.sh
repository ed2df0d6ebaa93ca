#!/usr/bin/env bash
# Build the venv the vllm-mlx tests run their servers in (default .venv-vllm; $1 names another).
# vllm-mlx 0.6 pins mlx-lm < 0.32 (the suite tests mlx-lm 0.32) and hard-requires torchvision,
# which pulls a multi-GB CUDA torch on Linux; its server needs neither torch nor gradio. So:
# vllm-mlx without its declared dependencies, then its runtime requirements except torch,
# torchvision and gradio, then mlxcache (editable, no deps) with its own. About 2 minutes and
# 1.1 GB; a venv already built by this recipe for this checkout is kept (a second or two).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-vllm}
PHASE=${2:-all}  # "deps": everything but mlxcache (scripts/test.sh runs it in the background)
PYTHON=${PYTHON:-python3}
STAMP="vllm-mlx==0.6.0 recipe 1 $(pwd)"
if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.mlxcache-recipe" 2>/dev/null)" = "$STAMP" ]; then
  exit 0
fi
PIP=("$VENV/bin/python" -m pip install -q)
if [ "$(cat "$VENV/.mlxcache-deps" 2>/dev/null)" != "$STAMP" ]; then
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  "${PIP[@]}" --upgrade pip
  "${PIP[@]}" --no-deps 'vllm-mlx==0.6.0'
  MLX='mlx>=0.29.0'
  if [ "$(uname -s)" = Linux ]; then MLX='mlx[cpu]>=0.29.0'; fi
  # vllm-mlx 0.6.0's Requires-Dist (its METADATA) without torch, torchvision and gradio
  "${PIP[@]}" "$MLX" 'mlx-lm>=0.31.3,<0.32.0' 'mlx-vlm>=0.6.5' 'transformers>=5.0.0' \
    'tokenizers>=0.19.0' 'huggingface-hub>=0.23.0' 'numpy>=1.24.0' 'pillow>=10.0.0' \
    'tqdm>=4.66.0' 'pyyaml>=6.0' 'requests>=2.28.0' 'tabulate>=0.9.0' 'opencv-python>=4.8.0' \
    'psutil>=5.9.0' 'fastapi>=0.100.0' 'starlette>=1.0.1' 'uvicorn>=0.23.0' \
    'prometheus-client>=0.20.0' 'mcp>=1.0.0' 'jsonschema>=4.0.0' 'lm-format-enforcer>=0.10.9' \
    'llguidance>=1.7.6' 'pytz>=2024.1' 'mlx-embeddings>=0.0.5'
  # mlxcache's own requirements
  "${PIP[@]}" 'msgpack>=1.0' 'safetensors>=0.4' 'redis>=5.0' 'xxhash>=3.0' 'blake3>=0.4' 'hiredis>=2.0'
  echo "$STAMP" > "$VENV/.mlxcache-deps"
fi
[ "$PHASE" = deps ] && exit 0
# mlxcache itself, from this checkout (apart from the deps phase: it writes into the source tree,
# as the main venv's install and the package build do, so it never runs beside them)
"${PIP[@]}" --no-deps -e .
"$VENV/bin/python" -c 'import vllm_mlx, mlxcache.integrations.vllm_mlx as v; v.check_version()'
echo "$STAMP" > "$VENV/.mlxcache-recipe"
