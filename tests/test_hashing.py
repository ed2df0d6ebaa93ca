"""Content hashes: stable across processes, by content, in order."""

import base64
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from mlxcache import hashing


def test_same_content_same_digest_whatever_the_form(tmp_path):
    raw = b"\x89PNG fake image bytes"
    path = tmp_path / "img.png"
    path.write_bytes(raw)
    b64 = base64.b64encode(raw).decode()
    forms = [raw, bytearray(raw), str(path), path, f"data:image/png;base64,{b64}", b64]
    assert len({hashing.image_digest(f) for f in forms}) == 1


def test_different_content_and_kinds_differ():
    a = np.zeros((2, 3), np.uint8)
    digests = {
        hashing.image_digest(a),
        hashing.image_digest(a.reshape(3, 2)),  # same bytes, other shape
        hashing.image_digest(a.astype(np.int8)),  # same bytes, other dtype
        hashing.image_digest(mx.zeros((2, 3))),
        hashing.image_digest(Image.new("RGB", (4, 4))),
        hashing.image_digest(Image.new("L", (4, 4))),
        hashing.image_digest("https://example.com/a.png"),
        hashing.image_digest("https://example.com/b.png"),
    }
    assert len(digests) == 8


def test_order_matters():
    assert hashing.images_digest([b"a", b"b"]) != hashing.images_digest([b"b", b"a"])
    assert hashing.images_digest([]) != hashing.images_digest([b""])


def test_unhashable_image_type_is_a_clear_error():
    with pytest.raises(TypeError, match="cannot hash an image of type object"):
        hashing.image_digest(object())


def test_block_chain_depends_on_everything_before():
    seed = hashing.namespace_seed("model-a")
    tokens = list(range(600))
    hs = hashing.block_hashes(seed, tokens, 256)
    assert len(hs) == 2  # the partial third block is not a whole block
    changed = hashing.block_hashes(seed, [1] + tokens[1:], 256)
    assert hs[0] != changed[0] and hs[1] != changed[1]
    assert hashing.block_hashes(hashing.namespace_seed("model-b"), tokens, 256) != hs
    assert hashing.block_hashes(hashing.namespace_seed("model-a", "tenant"), tokens, 256) != hs
    assert hashing.block_hashes(seed, tokens, 256, extras=[b"img"])[0] != hs[0]


def test_digests_do_not_depend_on_pythonhashseed():
    code = (
        "from mlxcache import hashing;"
        "print(hashing.block_hashes(hashing.namespace_seed('m'), list(range(300)), 128)[-1].hex())"
    )
    outs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                text=True, check=True).stdout)  # fmt: skip
    assert len(outs) == 1


def test_palette_images_count_by_their_colours():
    """Two "P" images with the same indices and other palettes are different pictures."""
    a = Image.new("P", (4, 4), 1)
    b = a.copy()
    a.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)  # index 1 is red
    b.putpalette([0, 0, 0, 0, 0, 255] + [0] * 762)  # index 1 is blue
    assert a.tobytes() == b.tobytes() and a.convert("RGB") != b.convert("RGB")
    assert hashing.image_digest(a) != hashing.image_digest(b)
    c = a.copy()
    c.info["transparency"] = 1  # index 1 is transparent: another RGBA picture
    assert hashing.image_digest(a) != hashing.image_digest(c)
    assert hashing.image_digest(a) == hashing.image_digest(a.copy())
