"""In-memory tiny VLMs from the JSON configs in ``mlxcache/data/tiny_models/`` (mlx-vlm 0.7)."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import mlx.core as mx

NAMES = ("qwen2_vl", "gemma3")


def load_config(name: str) -> dict[str, Any]:
    """A fresh copy of the named config dict."""
    if name not in NAMES:
        raise ValueError(f"unknown tiny model {name!r}; choose one of {', '.join(NAMES)}")
    text = resources.files("mlxcache.data").joinpath(f"tiny_models/{name}.json").read_text()
    return json.loads(text)


def build_model(name: str, seed: int = 0):
    """Build the named tiny model with reproducible random weights; returns (model, config)."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    cfg = load_config(name)
    arch, _ = get_model_and_args(cfg)
    model_config = arch.ModelConfig.from_dict(cfg)
    model_config = update_module_configs(model_config, arch, cfg, ["text", "vision"])
    mx.random.seed(seed)
    model = arch.Model(model_config)
    mx.eval(model.parameters())
    model.eval()
    return model, cfg
