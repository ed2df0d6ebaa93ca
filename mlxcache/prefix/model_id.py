"""Model identity strings for PrefixCache: what must match for two processes to share KV."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any

import mlx.core as mx

from mlxcache.buffers import array_memoryview

# config keys that name a copy of the weights rather than change what the model computes
_IGNORED = {"_name_or_path", "transformers_version", "_commit_hash", "torch_dtype_str"}


def _digest(data: bytes, n: int = 12) -> str:
    return hashlib.sha256(data).hexdigest()[:n]


def _config_of(obj: Any) -> dict[str, Any]:
    # first: an mlx Module is itself a dict. mlx-vlm models carry ``.config``, mlx-lm models
    # ``.args`` (a ModelArgs dataclass)
    for attr in ("config", "args"):
        cfg = getattr(obj, attr, None)
        if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
            return dataclasses.asdict(cfg)
        if isinstance(cfg, Mapping):
            return dict(cfg)
    if isinstance(obj, str | os.PathLike):
        path = os.path.join(os.fspath(obj), "config.json") if os.path.isdir(obj) else obj
        with open(path) as f:
            return json.load(f)
    if isinstance(obj, Mapping) and not hasattr(obj, "parameters"):
        return dict(obj)
    raise TypeError(
        "model_identity needs a model with a .config or .args, a config dict or a model "
        f"folder, got {type(obj).__name__}"
    )


def _canonical(cfg: Mapping[str, Any]) -> bytes:
    clean = {k: v for k, v in cfg.items() if k not in _IGNORED}
    return json.dumps(clean, sort_keys=True, separators=(",", ":"), default=repr).encode()


def _quantization(obj: Any, cfg: Mapping[str, Any]) -> str:
    q = cfg.get("quantization") or cfg.get("quantization_config")
    if isinstance(q, Mapping):
        bits, group = q.get("bits"), q.get("group_size")
        mode = q.get("mode", "affine")
        return f"{bits}b{group}{'' if mode == 'affine' else mode}"
    if hasattr(obj, "modules"):  # a loaded model: ask its quantized layers
        found = sorted(
            {
                f"{m.bits}b{m.group_size}{getattr(m, 'mode', 'affine').replace('affine', '')}"
                for m in obj.modules()
                if hasattr(m, "bits") and hasattr(m, "group_size")
            }
        )
        if found:
            return "+".join(found)
    return "none"


def _weights(obj: Any, values: bool) -> str:
    from mlx.utils import tree_flatten

    h = hashlib.sha256()
    for name, a in sorted(tree_flatten(obj.parameters()), key=lambda kv: kv[0]):
        h.update(f"{name}:{a.shape}:{a.dtype};".encode())
        if values:
            a = mx.contiguous(a)
            mx.eval(a)
            h.update(array_memoryview(a).cast("B"))
    return h.hexdigest()[:12]


def model_identity(
    model_or_config: Any,
    *,
    name: str | None = None,
    revision: str | None = None,
    hash_weights: bool = False,
) -> str:
    """``model_type[:name]/cfg-<digest>/q-<bits>b<group>[/w-<digest>][@revision]``.

    Accepts an mlx-vlm model (its ``.config``) or an mlx-lm model (its ``.args``), quantization
    read from its layers; a config dict or a model folder (``config.json``). A model object
    also adds a digest of its parameters' names, shapes and dtypes; ``hash_weights=True`` adds
    their bytes too (exact, about a second per GB). Give ``revision`` (a commit, a checkpoint
    tag) when two weight sets share a config, e.g. fine-tunes: otherwise they would share KV.
    A loaded mlx-lm model's ``.args`` keep only the keys its architecture reads, so its
    identity differs from its folder's (use one form on every process that shares a cache).
    """
    cfg = _config_of(model_or_config)
    model_type = cfg.get("model_type") or "model"
    out = f"{model_type}:{name}" if name else str(model_type)
    out += f"/cfg-{_digest(_canonical(cfg))}/q-{_quantization(model_or_config, cfg)}"
    if hasattr(model_or_config, "parameters") and callable(model_or_config.parameters):
        out += f"/w-{_weights(model_or_config, hash_weights)}"
    if revision:
        out += f"@{revision}"
    return out
