"""Under ``mlxcache serve --engine mlx-vlm``, a family the table refuses gets no prefix cache.

The server's APC factory (mlx-vlm's ``apc.from_env``, as mlxcache replaces it) reads the model
folder's ``config.json``: a refused family runs mlx-vlm's own path, said in one line per load;
any other family gets the shared prefix cache.
"""

from __future__ import annotations

import json
import logging

import pytest

pytest.importorskip("mlx_vlm")


def _folder(tmp_path, model_type: str):
    folder = tmp_path / model_type
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    return str(folder)


def test_a_refused_family_gets_no_prefix_cache_and_one_line(tmp_path, caplog):
    from mlx_vlm import apc

    from mlxcache import open_backend
    from mlxcache.integrations.mlx_vlm import server
    from mlxcache.integrations.mlx_vlm.models import FAMILIES

    refused = next(name for name, row in FAMILIES.items() if row.refuse)
    options = server._options().parse_args(["--cache", "memory://"])
    backend = open_backend("memory://")
    installed = server.install_all(options, backend)
    try:
        with caplog.at_level(logging.INFO, logger="mlxcache"):
            assert apc.from_env(_folder(tmp_path, refused) + "#0", {"enabled": True}) is None
            manager = apc.from_env(_folder(tmp_path, "qwen2_vl") + "#0", {"enabled": True})
        assert manager is not None and installed.managers == [manager]
        told = [m for m in caplog.messages if "own path" in m]
        assert len(told) == 1 and refused in told[0] and FAMILIES[refused].refuse in told[0]
    finally:
        installed.uninstall()
        backend.close()
