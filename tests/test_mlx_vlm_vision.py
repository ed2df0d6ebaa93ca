"""SharedVisionFeatureCache: mlx-vlm's VisionFeatureCache with a shared tier.

Keys are mlx-vlm's own (``processed_image_key`` of real pixel arrays); a second instance (a
new process, another worker) finds what the first stored, another model never does, path keys
stay in the process, and a dead backend is a miss.
"""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm.vision_cache import VisionFeatureCache, processed_image_key
from redis_server import RedisServer

from mlxcache.integrations.mlx_vlm.vision import SharedVisionFeatureCache


def pixels(seed):
    return mx.array(np.random.default_rng(seed).standard_normal((64, 1176)).astype(np.float32))


def key(seed):
    return processed_image_key(pixels(seed), image_grid_thw=mx.array([[1, 8, 8]]))


def features(seed):
    return mx.array(np.random.default_rng(seed + 100).standard_normal((16, 256)), dtype=mx.bfloat16)


def same(a, b):
    return a.dtype == b.dtype and mx.array_equal(a.view(mx.uint16), b.view(mx.uint16))


def test_it_is_mlx_vlms_interface():
    c = SharedVisionFeatureCache(2, model="m", backend="memory://")
    assert isinstance(c, VisionFeatureCache)
    c.put(key(1), features(1))
    c.put(key(2), features(2))
    c.put(key(3), features(3))  # the hot tier holds max_size, as mlx-vlm's
    assert len(c) == 2
    assert same(c.get(key(3)), features(3))
    assert key(1) in c  # evicted from the hot tier, still in the shared one
    assert same(c.get(key(1)), features(1))
    assert c.counts["shared_hits"] == 1


def test_a_new_process_skips_the_encoder(tmp_path):
    uri = f"file://{tmp_path}/v"
    c = SharedVisionFeatureCache(model="qwen2-vl/x", backend=uri)
    c.put(key(5), [features(5), features(6)])  # encode_images returns a sequence
    c.close()
    code = (
        "import sys, mlx.core as mx, numpy as np\n"
        "from mlx_vlm.vision_cache import processed_image_key\n"
        "from mlxcache.integrations.mlx_vlm.vision import SharedVisionFeatureCache\n"
        "px = mx.array(np.random.default_rng(5).standard_normal((64, 1176)).astype(np.float32))\n"
        "k = processed_image_key(px, image_grid_thw=mx.array([[1, 8, 8]]))\n"
        "c = SharedVisionFeatureCache(model='qwen2-vl/x', backend=sys.argv[1])\n"
        "f = c.get(k)\n"
        "print(len(f), f[0].dtype, f[1].view(mx.uint16).sum().item())\n"
    )
    run = subprocess.run([sys.executable, "-c", code, uri], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [
        "2",
        "mlx.core.bfloat16",
        str(features(6).view(mx.uint16).sum().item()),
    ]


def test_models_and_paths_do_not_share(tmp_path):
    uri = f"file://{tmp_path}/v"
    a = SharedVisionFeatureCache(model="model-a", backend=uri)
    b = SharedVisionFeatureCache(model="model-b", backend=uri)
    a.put(key(1), features(1))
    assert b.get(key(1)) is None and key(1) not in b
    a.put("/images/cat.jpg", features(2))  # a path names a file, not its content
    a2 = SharedVisionFeatureCache(model="model-a", backend=uri)
    assert a2.get("/images/cat.jpg") is None
    assert same(a2.get(key(1)), features(1))
    a.clear()  # mlx-vlm's server clears on a model swap: the shared tier stays
    assert len(a) == 0 and same(a.get(key(1)), features(1))
    assert a.clear_shared() == 1 and a2.get(key(9)) is None


def test_dead_redis_is_a_miss():
    server = RedisServer()
    url = server.url
    server.close()
    c = SharedVisionFeatureCache(model="m", backend=url + "?timeout=0.2")
    c.put(key(1), features(1))  # kept in the process, not raised
    assert same(c.get(key(1)), features(1))
    c2 = SharedVisionFeatureCache(model="m", backend=url + "?timeout=0.2")
    assert c2.get(key(1)) is None


def test_a_forged_record_is_a_miss(tmp_path):
    from mlxcache import Record

    c = SharedVisionFeatureCache(model="m", backend="memory://")
    c.backend.put(c._shared_key(key(1)), Record({"x": mx.zeros((2,))}, {}))
    assert c.get(key(1)) is None and c.counts["errors"] == 1


def test_model_is_required():
    with pytest.raises(ValueError):
        SharedVisionFeatureCache(model="", backend="memory://")
