"""The server's vision feature cache (``server_vision``): it shares content-keyed features only
once bound to the model being loaded, never one model's with another, and a request tenant's
(``vision_tenant``) with no other tenant."""

from __future__ import annotations

from queue import Queue

import mlx.core as mx

from mlxcache.integrations.mlx_vlm import vision_tenant
from mlxcache.integrations.mlx_vlm.apc import Installed
from mlxcache.integrations.mlx_vlm.server_vision import VisionBinder
from mlxcache.integrations.mlx_vlm.vision import SharedVisionFeatureCache
from mlxcache.integrations.mlx_vlm.vision_tenant import tenant_key, with_tenant
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


def test_a_tenant_reads_and_writes_only_its_own_features():
    backend = open_backend("memory://")
    binder = VisionBinder(backend)
    cache = binder.make(4)
    binder.bind("model-a")
    alice, bob, plain = (mx.full((3, 4), float(v)) for v in (1, 2, 3))
    with_tenant("alice", cache.put, KEY, alice)
    assert with_tenant("bob", cache.get, KEY) is None and cache.get(KEY) is None
    assert cache.counts == {**cache.counts, "hot_hits": 0, "shared_hits": 0, "misses": 2}
    with_tenant("bob", cache.put, KEY, bob)
    cache.put(KEY, plain)
    assert mx.array_equal(with_tenant("bob", cache.get, KEY), bob) and cache.counts["hot_hits"] == 1
    assert len(list(backend.keys(""))) == 3
    # another process on the same store: each tenant's from the shared tier, no one else's
    peer_binder = VisionBinder(backend)
    peer = peer_binder.make(4)
    peer_binder.bind("model-a")
    assert mx.array_equal(with_tenant("alice", peer.get, KEY), alice)
    assert mx.array_equal(with_tenant("bob", peer.get, KEY), bob)
    assert with_tenant("carol", peer.get, KEY) is None and peer.counts["shared_hits"] == 2
    # no tenant: the key a cache without tenants always used (stores made before stay valid)
    before = SharedVisionFeatureCache(4, model="model-a", backend=backend)
    assert mx.array_equal(before.get(KEY), plain) and before.counts["shared_hits"] == 1


def test_install_tags_queued_requests_and_is_undone():
    from mlx_vlm import server
    from mlx_vlm.server import generation

    names = [(generation, "QueuedGenerationRequest"), (generation.ResponseGenerator, "_gpu_embed")]
    names += [(server, "stream_generate"), (server, "generate")]
    stock = [getattr(obj, name) for obj, name in names]
    installed = Installed()
    vision_tenant.install(installed)
    try:
        assert all(getattr(o, n) is not s for (o, n), s in zip(names, stock, strict=True))
        inputs = {"input_ids": mx.array([[1, 2]])}
        for tenant in ("alice", None):
            args = generation.GenerationArguments(tenant_id=tenant)
            queued = generation.QueuedGenerationRequest(Queue(), inputs, 2, args)
            assert queued.raw_inputs == inputs
            assert getattr(queued.raw_inputs, "tenant", None) == tenant
        assert generation.QueuedGenerationRequest(Queue(), inputs, 2, args).raw_inputs is inputs
    finally:
        installed.uninstall()
    assert all(getattr(o, n) is s for (o, n), s in zip(names, stock, strict=True))


def test_a_stream_holds_its_tenant_only_while_it_runs():
    def stream(**_):
        for _ in range(2):
            yield tenant_key(KEY)

    wrapped = vision_tenant._stream_with_tenant(stream)
    steps = wrapped(apc_tenant="alice")
    first = next(steps)
    assert first.startswith(f"{KEY}|tenant:") and tenant_key(KEY) == KEY  # not between steps
    assert list(steps) == [first]
    assert list(wrapped()) == [KEY, KEY]  # no tenant: the key as it was
