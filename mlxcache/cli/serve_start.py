"""What ``mlxcache serve`` checks before any engine loads: the model's ``config.json``, the address.

Each failure is a ``StartError`` whose message is the one line the user sees (exit 1), so a bad
model, an unreachable Hub or a busy port never leaves a half-started server behind.
"""

from __future__ import annotations

import glob
import json
import os
import socket

DEFAULT_HOST = "127.0.0.1"  # every engine: a cache of other people's prompts stays local
DEFAULT_PORTS = {"mlx-lm": 8080, "mlx-vlm": 8080, "vllm-mlx": 8000}  # each engine's own


class StartError(Exception):
    """A reason the server cannot start, as one line."""


def _looks_like_path(model: str) -> bool:
    """A folder name rather than a Hugging Face id (``owner/name`` or ``name``)."""
    return model.startswith((".", "/", "~")) or model.count("/") > 1 or "\\" in model


def _hub_config(model: str, engine: str | None) -> str:
    """The local path of ``model``'s ``config.json``, fetched (that file only) if not cached."""
    hint = (
        "" if engine else ": pass --engine mlx-lm, --engine mlx-vlm or --engine vllm-mlx to choose"
    )
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import (
            EntryNotFoundError,
            HFValidationError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
        )
    except ImportError:
        raise StartError(
            f"--model {model}: no such folder, and huggingface_hub is not installed to fetch "
            f"its config.json{hint}"
        ) from None
    try:
        return hf_hub_download(model, "config.json")
    except HFValidationError:
        raise StartError(f"--model {model}: no such folder, nor a Hugging Face id") from None
    except LocalEntryNotFoundError:  # offline (HF_HUB_OFFLINE or no network) and not cached
        raise StartError(
            f"--model {model}: its config.json is not in the Hugging Face cache and the Hub "
            f"cannot be reached (offline){hint}"
        ) from None
    except RepositoryNotFoundError:
        raise StartError(
            f"--model {model}: no such model on the Hugging Face Hub (or it is private)"
        ) from None
    except EntryNotFoundError:
        raise StartError(f"--model {model}: the model has no config.json") from None
    except OSError as exc:  # network failures other than offline mode
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StartError(f"--model {model}: cannot fetch its config.json: {first}{hint}") from None


def model_config(model: str, engine: str | None = None) -> dict:
    """The ``config.json`` of a model folder or Hugging Face id (only that file is fetched)."""
    expanded = os.path.expanduser(model)
    if os.path.isdir(expanded):
        path = os.path.join(expanded, "config.json")
        if not os.path.isfile(path):
            raise StartError(f"--model {model}: the folder has no config.json")
    elif os.path.exists(expanded):
        raise StartError(f"--model {model}: not a folder")
    elif _looks_like_path(model):
        raise StartError(f"--model {model}: no such folder")
    else:
        path = _hub_config(model, engine)
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise StartError(f"--model {model}: unreadable config.json: {exc}") from None
    if not isinstance(config, dict):
        raise StartError(f"--model {model}: config.json is not a JSON object")
    return config


def check_weights(model: str, engine: str) -> None:
    """A local folder must hold safetensors weights: every engine's loader fails without them."""
    folder = os.path.expanduser(model)
    if os.path.isdir(folder) and not glob.glob(os.path.join(folder, "*.safetensors")):
        raise StartError(
            f"--model {model}: {engine} cannot load it: no *.safetensors in the folder"
        )


def pick_engine(config: dict) -> str:
    """mlx-vlm for a config with a ``vision_config``, else mlx-lm."""
    return "mlx-vlm" if isinstance(config.get("vision_config"), dict) else "mlx-lm"


def check_address(host: str, port: int) -> None:
    """Raise ``StartError`` unless ``host:port`` can be listened on now (as the servers bind)."""
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as http.server and uvicorn
            s.bind(address)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise StartError(f"cannot listen on {shown}: {reason.lower()}") from None
