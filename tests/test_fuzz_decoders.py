"""Property tests of every decoder on random and mutated valid inputs (hypothesis).

Each decoder must answer a value or its documented error (FormatError, or None for the chunk
manifest) for any input, and a decoded record must match its checked header. Run with
``--fuzz-long`` for 50x more (randomized) examples; the cases found are kept at the end of this
file as regression tests.
"""

from __future__ import annotations

import base64
import json
import struct

import mlx.core as mx
import msgpack
import pytest
from helpers import sample_record
from hypothesis import given
from hypothesis import strategies as s
from mlx_lm.models.cache import KVCache, QuantizedKVCache
from record_bytes import join, split

from mlxcache import FormatError, Record
from mlxcache.backends.redis.chunks import MANIFEST_MAGIC, MAX_CHUNKS, parse_manifest
from mlxcache.records import format as st
from mlxcache.records import meta as meta_codec
from mlxcache.records import reader as format_read
from mlxcache.records.signing import Signer
from mlxcache.serializers import dump_prompt_cache


def _kv_record() -> Record:
    kv, q = KVCache(), QuantizedKVCache(group_size=32, bits=4)
    x = mx.arange(2 * 3 * 32, dtype=mx.float32).reshape(1, 2, 3, 32)
    kv.update_and_fetch(x, -x)
    q.update_and_fetch(x, x)
    return dump_prompt_cache([kv, q], meta={"tokens": b"\x01" * 24, "n": [1, 2, {"a": None}]})


RECORDS = [sample_record(), Record({}, {}), _kv_record()]
SIGNER = Signer("fuzz-secret-0123456789abcdef")
BLOBS = [st.to_bytes(r) for r in RECORDS] + [st.to_bytes(RECORDS[0], key="k", signer=SIGNER)]

plain_json = s.recursive(
    s.none()
    | s.booleans()
    | s.integers(-(2**70), 2**70)
    | s.floats(allow_nan=True, allow_infinity=True)
    | s.text(max_size=8),
    lambda c: s.lists(c, max_size=5) | s.dictionaries(s.text(max_size=6), c, max_size=5),
    max_leaves=20,
)
msgpack_keys = s.text(max_size=4) | s.integers(-5, 5) | s.binary(max_size=3) | s.booleans()
msgpack_values = s.recursive(
    s.none()
    | s.booleans()
    | s.integers(-(2**63), 2**64 - 1)
    | s.floats()
    | s.text(max_size=8)
    | s.binary(max_size=8)
    | s.builds(msgpack.ExtType, s.integers(0, 127), s.binary(max_size=4))
    | s.builds(msgpack.Timestamp, s.integers(0, 2**34 - 1), s.integers(0, 999_999_999)),
    lambda c: s.lists(c, max_size=5) | s.dictionaries(msgpack_keys, c, max_size=5),
    max_leaves=25,
)


# ---------------------------------------------------------------- properties


def is_plain(x, depth: int = 0) -> bool:
    if x is None or type(x) in (bool, int, float, str, bytes):
        return True
    if type(x) is list:
        return all(is_plain(v, depth + 1) for v in x)
    if type(x) is dict:
        return all(type(k) is str and is_plain(v, depth + 1) for k, v in x.items())
    return False


def decode(blob: bytes, **kw) -> Record | None:
    """from_bytes must give a Record matching the header, or a FormatError; nothing else."""
    try:
        rec = st.from_bytes(blob, **kw)
    except FormatError:
        return None
    header = st.parse_header(blob, total_size=len(blob))
    assert set(rec.arrays) == {t.name for t in header.tensors}
    for t in header.tensors:
        a = rec.arrays[t.name]
        assert tuple(a.shape) == t.shape and a.nbytes == t.end - t.begin
    assert is_plain(dict(rec.meta))
    return rec


def rechecksum(header: dict, data: bytes) -> None:
    """Give an edited header the checksum (and version check) a careful forger would."""
    info = header.get("__metadata__")
    try:
        meta_bytes = base64.b64decode(info["meta"], validate=True)
        table = sorted(
            (
                st.TensorInfo(n, v["dtype"], tuple(v["shape"]), *v["data_offsets"])
                for n, v in header.items()
                if n != "__metadata__"
            ),
            key=lambda t: (t.begin, t.end),
        )
        pieces = [memoryview(data[t.begin : t.end]) for t in table]
        info["checksum"] = st._checksum(meta_bytes, table, pieces)
        info["vcheck"] = st._vcheck(info["format_version"], info["checksum"], info.get("mac", ""))
    except Exception:
        pass  # a header too broken to checksum: the decoder must refuse it anyway


@s.composite
def mutated_bytes(draw) -> bytes:
    blob = bytearray(draw(s.sampled_from(BLOBS)))
    for _ in range(draw(s.integers(1, 4))):
        op = draw(s.sampled_from(["flip", "cut", "insert", "delete", "length", "overwrite"]))
        at = draw(s.integers(0, max(len(blob) - 1, 0)))
        if op == "flip" and blob:
            blob[at] ^= 1 << draw(s.integers(0, 7))
        elif op == "cut":
            del blob[at:]
        elif op == "insert":
            blob[at:at] = draw(s.binary(min_size=1, max_size=16))
        elif op == "delete":
            del blob[at : at + draw(s.integers(1, 16))]
        elif op == "length":
            blob[:8] = struct.pack("<Q", draw(s.integers(0, 2**64 - 1)))
        else:
            chunk = draw(s.binary(min_size=1, max_size=8))
            blob[at : at + len(chunk)] = chunk
    return bytes(blob)


def _paths(x, path=()):
    yield path
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _paths(v, (*path, k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _paths(v, (*path, i))


def _set(root, path, value):
    if not path:
        return value
    node = root
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return root


@s.composite
def edited_header(draw) -> bytes:
    """A valid blob with one header field replaced, then correctly re-checksummed."""
    header, data = split(draw(s.sampled_from(BLOBS)))
    paths = list(_paths(header))
    path = draw(s.sampled_from(paths[1:]))
    _set(header, path, draw(plain_json))
    if draw(s.booleans()):
        data = data[: draw(s.integers(0, len(data)))]
    rechecksum(header, data)
    return join(header, data)


@s.composite
def crafted_meta(draw) -> bytes:
    """A valid record whose metadata bytes are any msgpack (non-str keys, ext types, ...)."""
    header, data = split(draw(s.sampled_from(BLOBS[:3])))
    value = draw(msgpack_values)
    try:
        packed = msgpack.packb(value, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        packed = b"\xc1"  # never used by msgpack
    if draw(s.booleans()):
        packed = packed + draw(s.binary(max_size=4))
    header["__metadata__"]["meta"] = base64.b64encode(packed).decode()
    rechecksum(header, data)
    return join(header, data)


# ---------------------------------------------------------------- the record format


@given(s.binary(max_size=256))
def test_random_bytes_are_format_errors(blob):
    assert decode(blob) is None or blob in BLOBS


@given(mutated_bytes())
def test_mutated_records_decode_or_are_format_errors(blob):
    decode(blob)
    decode(blob, key="k", signer=SIGNER)
    try:
        st.parse_header(blob, total_size=len(blob))
    except FormatError:
        pass


@given(edited_header())
def test_rechecksummed_header_edits_decode_or_are_format_errors(blob):
    decode(blob)


@given(crafted_meta())
def test_any_msgpack_metadata_decodes_to_plain_data_or_a_format_error(blob):
    decode(blob)


@given(mutated_bytes())
def test_mutated_record_files_read_or_are_format_errors(tmp_path_factory, blob):
    path = tmp_path_factory.mktemp("f") / "r.safetensors"
    path.write_bytes(blob)
    try:
        rec = format_read.read_file(path)
    except FormatError:
        return
    header = format_read.read_header(path)
    for t in header.tensors:
        assert tuple(rec.arrays[t.name].shape) == t.shape


# ---------------------------------------------------------------- metadata


@given(s.binary(max_size=128))
def test_meta_unpack_of_random_bytes(data):
    try:
        value = meta_codec.unpack(data)
    except FormatError:
        return
    assert is_plain(value)


@given(msgpack_values)
def test_meta_unpack_of_any_msgpack(value):
    try:
        data = msgpack.packb(value, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return
    try:
        out = meta_codec.unpack(data)
    except FormatError:
        return
    assert is_plain(out)
    again = meta_codec.pack(out)  # what the reader accepted, a writer can store (NaN-safe)
    assert meta_codec.pack(meta_codec.unpack(again)) == again


# ---------------------------------------------------------------- the chunk manifest


def _checked_manifest(value: bytes) -> None:
    m = parse_manifest(value)
    if m is not None:
        assert set(m) == {"gen", "n", "size"} and 1 <= m["n"] <= MAX_CHUNKS
        assert type(m["n"]) is int and type(m["size"]) is int and m["n"] <= m["size"]


@given(s.binary(max_size=300))
def test_manifest_of_random_bytes(tail):
    _checked_manifest(MANIFEST_MAGIC + tail)
    _checked_manifest(tail)


@given(plain_json, s.booleans())
def test_manifest_of_any_json(value, merge):
    if merge and isinstance(value, dict):
        value = {"gen": "0" * 32, "n": 1, "size": 1, **value}
    _checked_manifest(MANIFEST_MAGIC + json.dumps(value).encode())


# ---------------------------------------------------------------- regression cases


@pytest.mark.parametrize(
    "shape",
    [
        [2**31, 0],  # MLX shapes are 32-bit: the file loader wrapped this to (0, 0)
        [2**40, 2**40, 0],  # numpy: "array is too big"
        [1] * 33,  # absurd rank
        [2**64],
        [-1],
        [True],
        [1.0],
        "3",
        [[1]],
    ],
)
def test_absurd_shapes_with_a_valid_checksum_are_format_errors(tmp_path, shape):
    header, data = split(st.to_bytes(Record({"x": mx.zeros((0,), dtype=mx.uint8)}, {})))
    header["x"]["shape"] = shape
    rechecksum(header, data)
    blob = join(header, data)
    with pytest.raises(FormatError):
        st.from_bytes(blob)
    (tmp_path / "r").write_bytes(blob)
    with pytest.raises(FormatError):
        format_read.read_file(tmp_path / "r")


@pytest.mark.parametrize(
    "meta",
    [
        b"\x81\x01\x02",  # {1: 2}: a non-str key
        b"\x81\xa1a\x81\xc4\x01b\x01",  # a nested bytes key
        b"\x91" * 100_000 + b"\xc0",  # 100k nested lists
        b"\xd4\x05\x00",  # an extension type
        b"\xd6\xff\x00\x00\x00\x01",  # a msgpack timestamp: not a map
        b"\xdd\xff\xff\xff\xff",  # a list of 2**32 items, without them
        b"\x90" * 1000,  # trailing data
        b"\xdc\x03\xe8" + b"\x90" * 1000,  # 1000 empty lists for 1003 bytes: a container flood
    ],
)
def test_malformed_metadata_is_a_format_error(meta):
    header, data = split(st.to_bytes(Record({}, {})))
    header["__metadata__"]["meta"] = base64.b64encode(meta).decode()
    rechecksum(header, data)
    with pytest.raises(FormatError):
        st.from_bytes(join(header, data))


def test_deep_json_and_huge_headers_are_format_errors():
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(FormatError):
        st.from_bytes(struct.pack("<Q", len(deep)) + deep)
    with pytest.raises(FormatError, match="limit"):
        st.from_bytes(struct.pack("<Q", st.MAX_HEADER_BYTES + 8) + b" " * 64)
    many = {f"t{i}": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]} for i in range(70000)}
    with pytest.raises(FormatError, match="tensors"):
        st.from_bytes(join({"__metadata__": {}, **many}, b""))
    with pytest.raises(ValueError, match="limit"):
        st.to_bytes(Record({}, {"x": b"\x00" * st.MAX_HEADER_BYTES}))


@pytest.mark.parametrize(
    "manifest",
    [
        {"gen": "0" * 32, "n": float("nan"), "size": 1},
        {"gen": "0" * 32, "n": float("inf"), "size": 1},
        {"gen": "0" * 32, "n": 10**12, "size": 10**13},  # a billion chunk keys
        {"gen": "0" * 32, "n": 5, "size": 2},  # more chunks than bytes
        {"gen": "0" * 32, "n": True, "size": 1},
        {"gen": "x y", "n": 1, "size": 1},
        {"gen": "0" * 32, "n": 1, "size": 1, "extra": [[[[[]]]]]},
        [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]],
    ],
)
def test_bad_manifests_are_refused(manifest):
    assert parse_manifest(MANIFEST_MAGIC + json.dumps(manifest).encode()) is None
    assert parse_manifest(MANIFEST_MAGIC + b"[" * 200_000) is None


def test_the_header_cap_is_ten_times_the_largest_real_header():
    """docs/reliability.md: a 100-layer quantized cache whose metadata holds a 128k-token
    prompt (what the MLLM manager stores per entry) is the largest real header we build."""
    import numpy as np

    layers = []
    for _ in range(100):
        c = QuantizedKVCache(group_size=64, bits=4)
        x = mx.zeros((1, 8, 16, 128))
        c.update_and_fetch(x, x)
        layers.append(c)
    tokens = np.arange(131072, dtype=np.int64).tobytes()
    head, _ = st.encode(dump_prompt_cache(layers, meta={"tokens": tokens, "model": "m" * 200}))
    assert 1_000_000 < len(head) and 10 * len(head) <= st.MAX_HEADER_BYTES


def test_mllm_entries_and_index_over_the_header_cap_are_not_stored_not_raised(tmp_path):
    """The MLLM index lines carry every entry's token ids: two prompts of 1M tokens make an
    index over the cap, three make an entry over it. Neither raises into store()."""
    from mlxcache.mllm_cache import MLLMPrefixCacheManager

    m = MLLMPrefixCacheManager(backend=f"file://{tmp_path}")
    kv = KVCache()
    kv.update_and_fetch(mx.zeros((1, 1, 2, 4)), mx.zeros((1, 1, 2, 4)))
    big = st.MAX_HEADER_BYTES // 8 // 4 * 3 // 2  # tokens: half the cap each, base64'd
    m.store([], "a", None, [kv], list(range(big)))
    m.store([], "b", None, [kv], list(range(big)))  # the index of both is over the cap
    assert m.fetch([], "a")[0] is not None and m.fetch([], "b")[0] is not None
    m.store([], "c", None, [kv], list(range(3 * big)))  # the entry itself is over the cap
    assert m.fetch([], "c") == (None, 0)


# ---------------------------------------------------------------- extension types (issue 21)


def has_ext(x) -> bool:
    """Whether a msgpack value holds an extension type (a Timestamp is extension -1)."""
    if isinstance(x, msgpack.ExtType | msgpack.Timestamp):
        return True
    if isinstance(x, list):
        return any(has_ext(v) for v in x)
    if isinstance(x, dict):
        return any(has_ext(k) or has_ext(v) for k, v in x.items())
    return False


def ext_record(value) -> bytes:
    """A record whose meta is ``{"m": value}`` packed by plain msgpack, checksummed as ours."""
    header, data = split(st.to_bytes(Record({"x": mx.zeros(3)}, {})))
    packed = msgpack.packb({"m": value}, use_bin_type=True)
    header["__metadata__"]["meta"] = base64.b64encode(packed).decode()
    rechecksum(header, data)
    return join(header, data)


@given(msgpack_values)
def test_metadata_with_an_extension_type_is_a_format_error(value):
    try:
        data = msgpack.packb(value, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return
    if not has_ext(value):
        return
    with pytest.raises(FormatError):
        meta_codec.unpack(data)
    with pytest.raises(FormatError):
        st.from_bytes(ext_record(value))


@pytest.mark.parametrize(
    "value",
    [msgpack.Timestamp(1_700_000_000, 5), [1, {"t": msgpack.Timestamp(0, 0)}],
     msgpack.ExtType(7, b"x")],
)  # fmt: skip
def test_a_timestamp_in_metadata_is_refused(value):
    with pytest.raises(FormatError, match="extension type"):
        st.from_bytes(ext_record(value))
