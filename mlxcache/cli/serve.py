"""``mlxcache serve [--engine mlx-lm|mlx-vlm|vllm-mlx]``: pick the engine, run its own server.

Without ``--engine`` the model's ``config.json`` (a folder, or fetched alone from the Hugging
Face Hub) decides: a ``vision_config`` means mlx-vlm, anything else mlx-lm; the choice is
printed. The model, the address (default 127.0.0.1 for every engine) and the port are checked
before the engine loads (``serve_start``). Every other option goes to the engine's server.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from importlib import metadata

from mlxcache.cli.serve_start import (
    DEFAULT_HOST,
    DEFAULT_PORTS,
    StartError,
    check_address,
    check_weights,
    model_config,
    pick_engine,
)
from mlxcache.uri import DEFAULT_URL

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


HELP = f"""usage: mlxcache serve [--engine {{{",".join(ENGINES)}}}] --model MODEL [options]

Runs an engine's own OpenAI-compatible server on a persistent, shared prompt cache.

engines:
  mlx-lm     text models (mlx_lm.server; pip install 'mlxcache[lm]')
  mlx-vlm    vision-language models (mlx_vlm.server; pip install 'mlxcache[vlm]')
  vllm-mlx   vllm-mlx's server (its own venv: scripts/vllm_venv.sh)
  Without --engine the model's config.json picks one (a vision_config means mlx-vlm, else
  mlx-lm); only that file is fetched for a Hugging Face id not yet downloaded.

every engine:
  --host HOST   default {DEFAULT_HOST} (this machine only: the cache holds every user's
                prompts); --host 0.0.0.0 opens the server to the network
  --cache URI   default $MLXCACHE_URL, else {DEFAULT_URL}
  a request's "cache_salt" (body) or X-Cache-Salt header keeps its cache entries its own
  mlxcache serve --engine ENGINE --help lists that engine's options.
"""


def _engine_help(engine: str, rest: list[str]) -> int:
    """The overview, then ``engine``'s own options when it is installed (exit 0 either way)."""
    print(HELP)
    if engine == "vllm-mlx":
        from mlxcache.integrations.vllm_mlx.server import main as vllm_main

        return vllm_main(rest)
    if engine == "mlx-vlm":
        problem = version_problem()
        if problem:
            print(f"({problem})")
            return 0
        from mlxcache.integrations.mlx_vlm.server import main as vlm_main

        return vlm_main(rest)
    from mlxcache.integrations.mlx_lm.server import INSTALL_HINT, installed
    from mlxcache.integrations.mlx_lm.server import main as lm_main

    if not installed():
        print(f"({INSTALL_HINT})")
        return 0
    return lm_main(rest)


def engine_problem(engine: str) -> str | None:
    """One line saying why ``engine`` cannot run here (not installed, untested version), or None."""
    if engine == "mlx-vlm":
        return version_problem()
    if engine == "vllm-mlx":
        from mlxcache.integrations.vllm_mlx.seam import VllmMlxVersionError, check_version

        try:
            check_version()
        except VllmMlxVersionError as exc:
            return str(exc)
        return None
    from mlxcache.integrations.mlx_lm.server import INSTALL_HINT, installed

    return None if installed() else INSTALL_HINT


def _start_checks(engine: str | None, model: str | None, host: str, port_text: str | None) -> str:
    """The engine to run, after every check that needs no model weights (``StartError``)."""
    if engine is not None and (problem := engine_problem(engine)):
        raise StartError(problem)
    if model is not None:
        config = model_config(model, engine)
        if engine is None:
            engine = pick_engine(config)
            has = "has a" if engine == "mlx-vlm" else "has no"
            print(f"mlxcache serve: engine {engine} (the model's config.json {has} "
                  "vision_config)", flush=True)  # fmt: skip
            if problem := engine_problem(engine):
                raise StartError(problem)
    if engine is None:  # no --model (mlx-lm's server then loads one per request)
        engine = "mlx-lm"
        if problem := engine_problem(engine):
            raise StartError(problem)
    if model is not None:
        check_weights(model, engine)
    try:
        port = DEFAULT_PORTS[engine] if port_text is None else int(port_text)
    except ValueError:
        raise StartError(f"--port {port_text}: not a number") from None
    check_address(host, port)
    shown = f"[{host}]" if ":" in host else host
    print(f"mlxcache serve: {engine} will listen on http://{shown}:{port}", flush=True)
    return engine


def serve(argv: Sequence[str]) -> int:
    """Run ``mlxcache serve``; returns the exit code (1 before any port opens on bad input)."""
    argv = list(argv)
    try:
        engine, rest = _take(argv, "--engine")
        model, _ = _take(rest, "--model")
        host, _ = _take(rest, "--host")
        port_text, _ = _take(rest, "--port")
    except ValueError as exc:
        print(f"mlxcache: error: {exc}", file=sys.stderr)
        return 2
    if engine is not None and engine not in ENGINES:
        print(
            f"mlxcache: error: unknown engine {engine!r}; choose one of {', '.join(ENGINES)}",
            file=sys.stderr,
        )
        return 2
    if "-h" in rest or "--help" in rest:
        return _engine_help(engine or "mlx-lm", rest)
    if host is None:
        host = DEFAULT_HOST
        rest += ["--host", host]
    try:
        engine = _start_checks(engine, model, host, port_text)
    except StartError as exc:
        print(f"mlxcache: error: {exc}", file=sys.stderr)
        return 1
    if engine == "vllm-mlx":
        from mlxcache.integrations.vllm_mlx.server import main as vllm_main

        return vllm_main(rest)
    if engine == "mlx-vlm":
        from mlxcache.integrations.mlx_vlm.server import main as vlm_main

        return vlm_main(rest)
    from mlxcache.integrations.mlx_lm.server import main as lm_main

    return lm_main(rest)
