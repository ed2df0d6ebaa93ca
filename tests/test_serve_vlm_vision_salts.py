"""A request's ``cache_salt`` reaches the vision feature cache of ``mlxcache serve --engine
mlx-vlm`` (issue 27, item 5): an image seen under one salt is encoded again under another (no
hot nor shared-tier hit), and requests without a salt keep the keys they always had.

A tiny Qwen3.5 folder (its server feeds mlx-vlm's vision feature cache in 0.7.10), one stock
and one mlxcache server started together (subprocesses, real HTTP, a ``file://`` store).
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

from vlm_server import VlmServer

from mlxcache.integrations.mlx_vlm.vision import KEY_ROOT
from mlxcache.serializers.prompt_cache import load_prompt_cache
from mlxcache.tiny_models import build_tiny_vlm
from mlxcache.uri import open_backend


def _vision_records(cache: str) -> set[str]:
    backend = open_backend(cache)
    try:
        return set(backend.keys(KEY_ROOT))
    finally:
        backend.close()


def _content_key(cache: str, bkey: str) -> str:
    """The content key a vision record was stored under (its metadata)."""
    backend = open_backend(cache)
    try:
        _, meta = load_prompt_cache(backend.get(bkey), return_metadata=True)
    finally:
        backend.close()
    return str(meta["key"])


def test_salted_image_features_are_the_salts_own(tmp_path):
    folder = str(build_tiny_vlm(tmp_path / "qwen3_5", family="qwen3_5"))
    cache = f"file://{tmp_path}/cache"
    with ThreadPoolExecutor(2) as pool:
        starting = [
            pool.submit(VlmServer, folder, None, tmp_path / "stock.log", plain=True),
            pool.submit(VlmServer, folder, cache, tmp_path / "ours.log"),
        ]
    servers = [f.result() for f in starting if f.exception() is None]
    seen = []  # (salt, answer, vision records after it)
    try:
        failed = [f.exception() for f in starting if f.exception() is not None]
        if failed:
            raise failed[0]
        stock, ours = servers
        want = {name: stock.chat([name])[0] for name in ("A", "B")}
        for salt, header, name in [
            (None, None, "A"),
            ("alice", None, "A"),
            (None, "bob", "A"),  # the header: the same salt as the body's
            ("bob", None, "A"),
            (None, None, "A"),
            ("alice", None, "B"),
        ]:
            text = ours.chat([name], salt=salt, header=header)[0]
            seen.append((salt or header, text == want[name], _vision_records(cache)))
    finally:
        for server in servers:
            server.kill()
    assert want["A"] != want["B"]  # the answer depends on the image
    assert all(equal for _, equal, _ in seen), [s[:2] for s in seen]
    counts = [len(records) for *_, records in seen]
    # a record is stored only when both tiers missed: alice's image is encoded again for bob
    # (a hot or shared-tier hit would store nothing); bob again and the unsalted repeat hit
    assert counts == [1, 2, 3, 3, 3, 4], counts
    # the unsalted image's record has the key it always had (mlx-vlm's content key, hashed);
    # a salted one's content key carries a digest of its tenant
    keys = {bkey: _content_key(cache, bkey) for bkey in seen[-1][2]}
    (unsalted,) = seen[0][2]
    assert keys[unsalted].startswith("processed:") and "|" not in keys[unsalted]
    salted = [k for b, k in keys.items() if b != unsalted]
    assert len(salted) == 3 and all("|tenant:" in k for k in salted)
    assert all(b.endswith(hashlib.sha256(k.encode()).hexdigest()) for b, k in keys.items())
