"""The record format: byte-exact round trips of every dtype, checks that catch corruption."""

import base64
import json
import struct

import mlx.core as mx
import pytest
import safetensors
from helpers import assert_same, bits, sample_record

from mlxcache import FormatError, Record, UnsupportedVersionError
from mlxcache.records import format as st
from mlxcache.records import reader as format_read


def test_bytes_round_trip_is_bit_exact_for_every_dtype():
    rec = sample_record()
    assert_same(rec, st.from_bytes(st.to_bytes(rec)))


def test_file_round_trip_and_other_readers(tmp_path):
    rec = sample_record()
    path = tmp_path / "r.safetensors"
    with open(path, "wb") as f:
        f.write(st.to_bytes(rec))
    assert_same(rec, format_read.read_file(path))
    # the file is a standard safetensors file: mx.load and the safetensors package open it
    del_f64 = {k: v for k, v in rec.arrays.items() if v.dtype != mx.float64}
    path2 = tmp_path / "r2.safetensors"
    with open(path2, "wb") as f:
        f.write(st.to_bytes(Record(del_f64, {})))
    loaded = mx.load(str(path2))
    assert bits(loaded["t10"]) == bits(rec.arrays["t10"])
    with safetensors.safe_open(str(path2), "numpy") as f:
        assert f.metadata()["format"] == "mlxcache"
        assert set(f.keys()) == set(del_f64)


def test_header_is_read_without_tensor_data(tmp_path):
    rec = sample_record()
    path = tmp_path / "r.safetensors"
    path.write_bytes(st.to_bytes(rec))
    header = format_read.read_header(path)
    assert header.meta["tokens"] == [1, 2, 3]
    assert header.version == st.FORMAT_VERSION
    assert header.total_size == path.stat().st_size


def test_flipped_bit_is_detected():
    blob = bytearray(st.to_bytes(sample_record()))
    blob[-5] ^= 0x01
    with pytest.raises(FormatError, match="checksum"):
        st.from_bytes(bytes(blob))


def test_truncated_and_foreign_blobs_are_format_errors():
    blob = st.to_bytes(sample_record())
    for bad in [blob[:-1], blob[:20], b"", b"hello world, not a record"]:
        with pytest.raises(FormatError):
            st.from_bytes(bad)
    header = json.dumps({"__metadata__": {"format": "pt"}}).encode()
    with pytest.raises(FormatError, match="not an mlxcache record"):
        st.from_bytes(struct.pack("<Q", len(header)) + header)


def test_newer_format_version_is_refused():
    from record_bytes import with_version

    blob = st.to_bytes(Record({"x": mx.zeros(3)}, {}))
    with pytest.raises(UnsupportedVersionError):
        st.from_bytes(with_version(blob, st.FORMAT_VERSION + 1))
    # a corrupted version field is corrupt, not newer: it is dropped, never kept forever
    with pytest.raises(FormatError) as err:
        st.from_bytes(with_version(blob, st.FORMAT_VERSION + 1, valid_check=False))
    assert not isinstance(err.value, UnsupportedVersionError)


def test_decoded_arrays_do_not_alias_the_blob():
    blob = bytearray(st.to_bytes(Record({"x": mx.arange(4, dtype=mx.int32)}, {})))
    rec = st.from_bytes(blob)
    blob[-4:] = b"\xff\xff\xff\xff"
    assert rec.arrays["x"].tolist() == [0, 1, 2, 3]


def test_bad_records_are_refused_before_writing():
    with pytest.raises(TypeError, match="mx.array"):
        Record({"x": [1, 2]}, {})
    with pytest.raises(TypeError, match="msgpack"):
        Record({}, {"obj": object()})
    with pytest.raises(TypeError, match="keys must be str"):
        Record({1: mx.zeros(1)}, {})
    with pytest.raises(ValueError, match="reserved"):
        Record({"__metadata__": mx.zeros(1)}, {})  # would overwrite the header's own entry


def split(blob: bytes, size: int, kind=bytes) -> list:
    return [kind(blob[i : i + size]) for i in range(0, len(blob), size)]


@pytest.mark.parametrize("size", [1, 7, 8, 13, 64, 100, 1000, 10**9])
def test_from_buffers_is_bit_exact_for_any_split(size):
    """Tensors straddling chunk boundaries, a header straddling them, one-byte chunks."""
    record = sample_record()
    blob = st.to_bytes(record)
    for kind in (bytes, memoryview, bytearray):
        assert_same(st.from_buffers(split(blob, size, kind)), record)
    # empty buffers anywhere change nothing
    parts = split(blob, size)
    assert_same(st.from_buffers([b"", *[x for p in parts for x in (p, b"")]]), record)


def test_from_buffers_views_whole_chunks_and_copies_only_straddlers(monkeypatch):
    record = Record({"a": mx.arange(64, dtype=mx.int32), "b": mx.arange(64, dtype=mx.int32)}, {})
    blob = st.to_bytes(record)
    head = len(blob) - 512
    chunks = [blob[: head + 256 + 8], blob[head + 256 + 8 :]]  # "b" straddles, "a" does not
    seen = []
    real = st._array_from_buffer
    monkeypatch.setattr(st, "_array_from_buffer", lambda t, buf: seen.append(buf) or real(t, buf))
    assert_same(st.from_buffers(chunks), record)
    assert [type(b) for b in seen] == [memoryview, bytes]
    assert seen[0].obj is chunks[0]  # a view of the chunk, not a copy


def test_from_buffers_detects_a_corrupt_or_missing_chunk():
    blob = st.to_bytes(sample_record())
    for size in (8, 100):
        parts = split(blob, size, bytearray)
        parts[-2][0] ^= 0x40
        with pytest.raises(FormatError, match="checksum"):
            st.from_buffers(parts)
        parts = split(blob, size)
        for bad in (parts[:-1], parts[1:], [*parts[:3], *parts[4:]]):
            with pytest.raises(FormatError):
                st.from_buffers(bad)
    with pytest.raises(FormatError):
        st.from_buffers([])


def test_foreign_shapes_are_format_errors_even_with_a_matching_checksum():
    """Someone else's writer computed a valid checksum; a bad shape is still a FormatError."""
    blob = st.to_bytes(Record({"x": mx.zeros((2,), dtype=mx.uint8)}, {}))
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    meta_bytes = base64.b64decode(header["__metadata__"]["meta"])
    for shape in ([-1, -2], [2.0], ["2"], [True, 2]):
        header["x"]["shape"] = shape
        table = [st.TensorInfo("x", "U8", tuple(shape), 0, 2)]
        header["__metadata__"]["checksum"] = st._checksum(meta_bytes, table, iter([blob[-2:]]))
        text = json.dumps(header).encode()
        with pytest.raises(FormatError):
            st.from_bytes(struct.pack("<Q", len(text)) + text + blob[-2:])


def test_from_buffers_consume_drops_each_chunk_once_decoded():
    record = sample_record()
    chunks = split(st.to_bytes(record), 50)
    assert_same(st.from_buffers(chunks, consume=True), record)
    assert all(c is None for c in chunks)
    corrupt = split(st.to_bytes(record), 50, bytearray)
    corrupt[-1][-1] ^= 1
    with pytest.raises(FormatError):
        st.from_buffers(corrupt, consume=True)  # verified before anything is dropped
