"""``mlxcache serve [--engine mlx-lm|mlx-vlm|vllm-mlx]``: pick the engine, run its own server.

Without ``--engine`` the model's ``config.json`` (a folder, or a Hugging Face id already in the
local cache) decides: a ``vision_config`` means mlx-vlm, anything else mlx-lm; the choice is
printed. With no config here, mlx-lm (the default) runs and fetches the model. Every other
option goes to the engine's server.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from importlib import metadata

ENGINES = ("mlx-lm", "mlx-vlm", "vllm-mlx")
# mlx-vlm versions whose server seam (apc.from_env, APCManager, hash_image_payload,
# server.app.VisionFeatureCache) has the names and signatures mlxcache replaces
VLM_TESTED = ((0, 7, 5), (0, 8, 0))
VLM_TESTED_TEXT = ">=0.7.5,<0.8"
VLM_INSTALL_HINT = f"pip install 'mlxcache[vlm]' (mlx-vlm{VLM_TESTED_TEXT})"


def version_problem() -> str | None:
    """One line saying why the installed mlx-vlm cannot be used, or None."""
    try:
        found = metadata.version("mlx-vlm")
    except metadata.PackageNotFoundError:
        return f"mlxcache serve --engine mlx-vlm needs mlx-vlm, not installed: {VLM_INSTALL_HINT}"
    parts = []
    for p in found.split(".")[:3]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits) if digits else 0)
    version = tuple(parts + [0] * (3 - len(parts)))
    if not VLM_TESTED[0] <= version < VLM_TESTED[1]:
        return (
            f"mlxcache serve --engine mlx-vlm is tested with mlx-vlm{VLM_TESTED_TEXT}, "
            f"found {found}: {VLM_INSTALL_HINT}"
        )
    return None


def _take(argv: list[str], flag: str) -> tuple[str | None, list[str]]:
    """The value of ``flag`` (``--flag V`` or ``--flag=V``) and argv without it."""
    rest: list[str] = []
    value = None
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == flag:
            if i + 1 >= len(argv):
                raise ValueError(f"{flag} needs a value")
            value = argv[i + 1]
            i += 2
            continue
        if a.startswith(flag + "="):
            value = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    return value, rest


def model_config(model: str) -> dict | None:
    """The ``config.json`` of a model folder, or of a Hugging Face id already downloaded.

    None when there is none here (nothing is fetched: the engine's server does that).
    """
    path: str | None
    if os.path.isdir(model):
        path = os.path.join(model, "config.json")
    else:
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(model, "config.json")
        except Exception:  # not a repo id
            found = None
        path = found if isinstance(found, str) else None
    if path is None or not os.path.isfile(path):
        return None
    with open(path) as f:
        config = json.load(f)
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object")
    return config


def pick_engine(config: dict) -> str:
    """mlx-vlm for a config with a ``vision_config``, else mlx-lm."""
    return "mlx-vlm" if isinstance(config.get("vision_config"), dict) else "mlx-lm"


def serve(argv: Sequence[str]) -> int:
    """Run ``mlxcache serve``; returns the exit code (1 before any port opens on bad input)."""
    argv = list(argv)
    try:
        engine, rest = _take(argv, "--engine")
        model, _ = _take(rest, "--model")
    except ValueError as exc:
        print(f"mlxcache: error: {exc}", file=sys.stderr)
        return 2
    if engine is not None and engine not in ENGINES:
        print(
            f"mlxcache: error: unknown engine {engine!r}; choose one of {', '.join(ENGINES)}",
            file=sys.stderr,
        )
        return 2
    helping = "-h" in rest or "--help" in rest
    if engine is None and model is not None and not helping:
        try:
            config = model_config(model)
        except (OSError, ValueError) as exc:
            print(f"mlxcache: error: --model {model}: unreadable config: {exc}", file=sys.stderr)
            return 1
        if config is not None:  # else mlx-lm, the default, whose server fetches the model
            engine = pick_engine(config)
            why = "has a vision_config" if engine == "mlx-vlm" else "has no vision_config"
            print(f"mlxcache serve: engine {engine} (the model's config {why})", file=sys.stderr)
    if engine == "vllm-mlx":  # checks its own version range before it imports vllm-mlx
        from mlxcache.integrations.vllm_mlx.server import main as vllm_main

        return vllm_main(rest)
    if engine == "mlx-vlm":
        problem = version_problem()
        if problem:
            print(f"mlxcache: error: {problem}", file=sys.stderr)
            return 1
        from mlxcache.integrations.mlx_vlm.server import main as vlm_main

        return vlm_main(rest)
    from mlxcache.integrations.mlx_lm.server import main as lm_main

    return lm_main(rest)
