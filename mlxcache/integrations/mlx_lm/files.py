"""mlx-lm prompt-cache files (``mlx_lm.cache_prompt``, ``--prompt-cache-file``) <-> records.

A file written by ``mlx_lm.models.cache.save_prompt_cache`` becomes one plain record (the
cache through mlxcache's own encoding, the file's string metadata kept under
``meta["mlx_lm"]``) under a record key of the caller's choice, and back: ``export_file`` writes
a file that ``mlx_lm.models.cache.load_prompt_cache`` and ``mlx_lm.generate
--prompt-cache-file`` read. The files carry no token ids, so they are plain records, not
``PrefixCache`` entries (which are keyed by the tokens they hold).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from mlxcache.backends.base import CacheBackend
from mlxcache.errors import FormatError
from mlxcache.serializers.prompt_cache import dump_prompt_cache, load_prompt_cache

KIND = "mlx-lm-prompt-cache"
KEY_ROOT = "mlx-lm/"
INSTALL_HINT = "mlx-lm prompt-cache files need mlx-lm: pip install 'mlxcache[lm]'"


class FileError(ValueError):
    """A file or record that is not an mlx-lm prompt cache (the message says why)."""


def default_key(path: str | os.PathLike[str]) -> str:
    """``mlx-lm/<file name without .safetensors>``: the key ``import_file`` uses by default."""
    name = Path(path).name
    return KEY_ROOT + (name[: -len(".safetensors")] if name.endswith(".safetensors") else name)


def _mlx_lm_cache():
    try:
        from mlx_lm.models import cache
    except ImportError:
        raise FileError(INSTALL_HINT) from None
    return cache


def read_file(path: str | os.PathLike[str]) -> tuple[list[Any], dict[str, str]]:
    """The cache objects and string metadata of an mlx-lm prompt-cache file."""
    lib = _mlx_lm_cache()
    if not os.path.isfile(path):
        raise FileError(f"no such file: {path}")
    try:
        cache, metadata = lib.load_prompt_cache(os.fspath(path), return_metadata=True)
    except Exception as exc:  # mx.load or mlx-lm's decoder: not a prompt-cache file
        raise FileError(f"{path} is not an mlx-lm prompt-cache file: {exc}") from None
    if not isinstance(cache, list) or not isinstance(metadata, dict):
        raise FileError(f"{path} is not an mlx-lm prompt-cache file")
    return cache, {str(k): str(v) for k, v in metadata.items()}


def import_file(
    path: str | os.PathLike[str], backend: CacheBackend, key: str | None = None
) -> tuple[str, int]:
    """Store an mlx-lm prompt-cache file as one record; returns ``(key, layers)``.

    Raises FileError for a file that is not one, or when the backend did not keep it.
    """
    cache, metadata = read_file(path)
    key = key or default_key(path)
    record = dump_prompt_cache(
        cache, meta={"kind": KIND, "mlx_lm": metadata, "source": Path(path).name}
    )
    backend.put(key, record)
    if key not in backend:
        raise FileError(f"the cache did not keep {key} (over its max_bytes, or unreachable)")
    return key, len(cache)


def export_file(backend: CacheBackend, key: str, path: str | os.PathLike[str]) -> dict[str, str]:
    """Write the record ``key`` as an mlx-lm prompt-cache file; returns its metadata.

    The record must hold a list of mlx-lm cache objects (one imported, or any stored with
    ``dump_prompt_cache``). The file appears whole or not at all (a temp file, then a rename).
    """
    lib = _mlx_lm_cache()
    path = os.fspath(path)
    if not path.endswith(".safetensors"):
        raise FileError(f"mlx-lm prompt-cache files end in .safetensors: {path}")
    record = backend.get(key)
    if record is None:
        raise FileError(f"no such key: {key}")
    try:
        cache, meta = load_prompt_cache(record, return_metadata=True)
    except FormatError as exc:
        raise FileError(f"{key} holds no prompt cache: {exc}") from None
    layers = cache if isinstance(cache, list) else None
    if not layers or not all(type(c).__module__ == lib.__name__ for c in layers):
        raise FileError(f"{key} is not a list of mlx-lm cache objects")
    metadata = meta.get("mlx_lm") if isinstance(meta, dict) else None
    metadata = {str(k): str(v) for k, v in (metadata or {}).items()}
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".mlxcache-export-", suffix=".safetensors")
    os.close(fd)
    try:
        lib.save_prompt_cache(tmp, layers, metadata)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return metadata
