"""The server's vision feature cache (``server_vision``): it shares content-keyed features only
once bound to the model being loaded, and never one model's with another."""

from __future__ import annotations

import mlx.core as mx

from mlxcache.integrations.mlx_vlm.server_vision import VisionBinder
from mlxcache.uri import open_backend

KEY = "processed:12345"  # mlx-vlm's content keys (processed_image_key)


def test_vision_cache_shares_only_once_bound():
    backend = open_backend("memory://")
    binder = VisionBinder(backend)
    features = mx.arange(12, dtype=mx.float32).reshape(3, 4)
    early = binder.make(4)
    early.put(KEY, features)  # not bound yet: kept in the process only
    assert early.get(KEY) is not None and list(backend.keys("")) == []
    binder.bind("model-a")
    assert early.get(KEY) is not None  # what it held is kept
    early.put("processed:6789", features)
    assert len(list(backend.keys(""))) == 1
    # another server process (a new cache) bound to the same model finds it; another model not
    same = VisionBinder(backend)
    peer = same.make(4)
    same.bind("model-a")
    found = peer.get("processed:6789")
    assert found is not None and mx.array_equal(found, features)
    other = VisionBinder(backend)
    stranger = other.make(4)
    other.bind("model-b")
    assert stranger.get("processed:6789") is None
    # a cache made while another model loads is bound to that one only
    late = binder.make(4)
    assert late.get("processed:6789") is None
