"""Format 2: tensors hashed in 256 KiB pieces; files read by either path, in parallel.

Every byte of every piece is covered (first, last, across piece and tensor boundaries), a file
cut short is caught, blobs split at boundaries unrelated to tensors or pieces decode, and
format-1 records (one sequential hash) are still read. Every test runs on both file read
paths: piece by piece into stand-in arrays (large records) and ``mx.load`` then the pieces'
hashes (small ones).
"""

import json
import logging
import os
import struct
import subprocess
import sys

import mlx.core as mx
import pytest
from helpers import ROOT, TESTS, assert_same, sample_record

from mlxcache import FormatError, Record, UntrustedRecordError
from mlxcache.backends.disk import DiskBackend
from mlxcache.records import digests
from mlxcache.records import format as st
from mlxcache.records import reader as format_read
from mlxcache.records.signing import Signer

PIECE = digests.PIECE
SECRET = "pieces-secret-0123456789"


@pytest.fixture(autouse=True, params=["piecewise", "loaded"])
def read_path(request, monkeypatch):
    """Run each test with files read piece by piece, then with ``mx.load`` and a hash after."""
    limit = 0 if request.param == "piecewise" else 1 << 62
    monkeypatch.setattr(format_read, "PIECEWISE_MIN_BYTES", limit)
    return request.param


def big_record() -> Record:
    """Tensors that span several pieces, with sizes that end mid-piece, plus small ones."""
    mx.random.seed(3)
    arrays = {
        "a": mx.random.normal((3, PIECE // 2 + 7)).astype(mx.bfloat16),  # 3 pieces + a tail
        "b": mx.random.randint(0, 255, (PIECE + 1,), dtype=mx.uint8),  # 2 pieces, 1-byte tail
        "c": mx.arange(5, dtype=mx.int32),
        "d": mx.zeros((0, 4), dtype=mx.float16),
        "e": mx.array(7, dtype=mx.int64),
        "f": mx.array([True, False, True]),
        "g": mx.array([1 + 2j, 3 - 4j], dtype=mx.complex64),
    }
    return Record(arrays, {"tokens": list(range(10))})


def write(path, record: Record, signer: Signer | None = None, key: str = "k") -> bytes:
    head, views = st.encode(record, key=key, signer=signer)
    blob = b"".join([head, *views])
    path.write_bytes(blob)
    return blob


def data_offset(blob: bytes) -> int:
    return 8 + struct.unpack("<Q", blob[:8])[0]


def flip(path, at: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x10
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("signed", [False, True])
def test_file_round_trip_every_dtype_through_the_piece_reader(tmp_path, signed):
    signer = Signer(SECRET) if signed else None
    rec = big_record()
    path = tmp_path / "r.safetensors"
    write(path, rec, signer)
    assert format_read.read_header(path).version == digests.FORMAT_VERSION == 2
    assert_same(rec, format_read.read_file(path, key="k", signer=signer))


def test_piece_table_cuts_each_tensor_every_piece():
    header = st.header_of(big_record())
    ranges = digests.pieces(header.tensors)
    a = next(t for t in header.tensors if t.name == "a")
    inside = [r for r in ranges if a.begin <= r[0] < a.end]
    assert [hi - lo for lo, hi in inside] == [PIECE, PIECE, PIECE, a.end - a.begin - 3 * PIECE]
    assert sum(hi - lo for lo, hi in ranges) == header.data_size  # every byte, once


def positions(blob: bytes) -> list[int]:
    """Bytes to flip: first and last data byte, each side of piece and tensor boundaries."""
    base, header = data_offset(blob), st.parse_header(blob, len(blob))
    out = {base, len(blob) - 1}
    for lo, hi in digests.pieces(header.tensors):
        out |= {base + lo, base + hi - 1}
    return sorted(out)


@pytest.mark.parametrize("signed", [False, True])
def test_a_flipped_byte_in_any_piece_is_caught_by_the_file_reader(tmp_path, signed):
    signer = Signer(SECRET) if signed else None
    path = tmp_path / "r.safetensors"
    blob = write(path, big_record(), signer)
    spots = positions(blob)
    assert len(spots) > 10
    for at in spots:
        path.write_bytes(blob)
        flip(path, at)
        with pytest.raises(FormatError, match="checksum mismatch"):
            format_read.read_file(path, key="k", signer=signer)


def test_swapped_pieces_do_not_verify(tmp_path):
    """The pieces' digests are hashed in order: same bytes in another order is corrupt."""
    rec = Record({"x": mx.random.randint(0, 255, (2 * PIECE,), dtype=mx.uint8)}, {})
    blob = st.to_bytes(rec)
    base = data_offset(blob)
    swapped = blob[:base] + blob[base + PIECE :] + blob[base : base + PIECE]
    with pytest.raises(FormatError, match="checksum mismatch"):
        st.from_bytes(swapped)
    path = tmp_path / "r.safetensors"
    path.write_bytes(swapped)
    with pytest.raises(FormatError, match="checksum mismatch"):
        format_read.read_file(path)


def test_a_file_cut_short_is_a_format_error(tmp_path):
    path = tmp_path / "r.safetensors"
    blob = write(path, big_record())
    path.write_bytes(blob[:-1])
    with pytest.raises(FormatError):
        format_read.read_file(path)
    # cut after its size was checked (another process truncating it): the read catches it
    header = st.parse_header(blob, len(blob))
    path.write_bytes(blob[: data_offset(blob) + PIECE + 3])
    with open(path, "rb") as f, pytest.raises(FormatError, match="truncated"):
        format_read._read_pieces(f.fileno(), header, None, None)


@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("chunk", [1, 777_777, PIECE - 1, PIECE + 5])
def test_blobs_split_anywhere_decode_and_catch_flips(signed, chunk):
    """Redis chunks end anywhere: a piece may straddle two chunks or more."""
    signer = Signer(SECRET) if signed else None
    rec = big_record()
    head, views = st.encode(rec, key="k", signer=signer)
    blob = b"".join([head, *views])
    if chunk == 1:  # the header alone, then the rest in 3 uneven parts
        cuts = [len(head), len(head) + 10, len(blob) - 2]
    else:
        cuts = list(range(chunk, len(blob), chunk))
    bounds = [0, *cuts, len(blob)]
    chunks = [blob[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    assert_same(rec, st.from_buffers(chunks, key="k", signer=signer))
    for at in positions(blob)[1::3]:
        bad = bytearray(blob)
        bad[at] ^= 1
        parts = [bytes(bad[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
        with pytest.raises(FormatError, match="checksum mismatch"):
            st.from_buffers(parts, key="k", signer=signer)


def test_a_forged_piece_with_a_fresh_checksum_fails_the_mac(tmp_path):
    signer = Signer(SECRET)
    path = tmp_path / "r.safetensors"
    blob = write(path, big_record(), signer)
    header = st.parse_header(blob, len(blob))
    base = data_offset(blob)
    bad = bytearray(blob)
    bad[-1] ^= 1
    views = [memoryview(bytes(bad[base + t.begin : base + t.end])) for t in header.tensors]
    fresh = digests.checksum(header.meta_bytes, header.tensors, views)
    (n,) = struct.unpack("<Q", blob[:8])
    info = json.loads(blob[8 : 8 + n])
    info["__metadata__"]["checksum"] = fresh
    info["__metadata__"]["vcheck"] = digests.vcheck("2", fresh, info["__metadata__"]["mac"])
    text = json.dumps(info).encode()
    text += b" " * (-(len(text) + 8) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(bad[base:]))
    assert format_read.read_file(path, key="k") is not None  # unsigned readers see a valid checksum
    with pytest.raises(UntrustedRecordError, match="MAC mismatch"):
        format_read.read_file(path, key="k", signer=signer)


def as_version_1(blob: bytes, signer: Signer | None = None, key: str = "k") -> bytes:
    """The blob as mlxcache with format 1 wrote it: one sequential hash over the bytes."""
    header = st.parse_header(blob, len(blob))
    base = header.data_offset
    views = [memoryview(blob[base + t.begin : base + t.end]) for t in header.tensors]
    mac = None if signer is None else signer.hasher()
    checksum, tag = digests.digest(
        header.meta_bytes, header.tensors, views, checksum=True, mac=mac, key=key, version=1
    )
    (n,) = struct.unpack("<Q", blob[:8])
    info = json.loads(blob[8 : 8 + n])
    meta = info["__metadata__"]
    meta["format_version"], meta["checksum"] = "1", checksum
    if signer is not None:
        meta["mac"] = f"blake3:{signer.key_id}:{tag}"
    meta["vcheck"] = digests.vcheck("1", checksum, meta.get("mac", ""))
    text = json.dumps(info).encode()
    text += b" " * (-(len(text) + 8) % 8)
    return struct.pack("<Q", len(text)) + text + blob[base:]


@pytest.mark.parametrize("signed", [False, True])
def test_format_1_records_are_still_read_and_checked(tmp_path, signed):
    signer = Signer(SECRET) if signed else None
    rec = big_record()
    old = as_version_1(st.to_bytes(rec, key="k", signer=signer), signer)
    path = tmp_path / "old.safetensors"
    path.write_bytes(old)
    assert format_read.read_header(path).version == 1
    assert_same(rec, format_read.read_file(path, key="k", signer=signer))
    assert_same(rec, st.from_buffers([old[:1000], old[1000:]], key="k", signer=signer))
    bad = bytearray(old)
    bad[-3] ^= 1
    path.write_bytes(bytes(bad))
    with pytest.raises(FormatError, match="checksum mismatch"):
        format_read.read_file(path, key="k", signer=signer)
    with pytest.raises(FormatError, match="checksum mismatch"):
        st.from_bytes(bytes(bad), key="k", signer=signer)


def test_float64_records_still_take_the_whole_file_path(tmp_path):
    rec = sample_record()  # has a float64 tensor, which mx.load cannot read
    path = tmp_path / "r.safetensors"
    write(path, rec)
    assert_same(rec, format_read.read_file(path))


def test_disk_backend_flipped_byte_in_the_last_piece_is_a_logged_miss(tmp_path, caplog):
    b = DiskBackend(tmp_path)
    rec = big_record()
    b.put("k", rec)
    (path,) = [p for p in (tmp_path / "data").rglob("*") if p.is_file()]
    flip(path, path.stat().st_size - 5)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mlxcache"):
        assert b.get("k") is None
    assert "'k'" in caplog.text and "checksum mismatch" in caplog.text
    b.put("k", rec)
    assert_same(rec, b.get("k"))


def test_returned_arrays_are_independent_of_later_reads(tmp_path):
    """Arrays come from MLX's buffer cache: a later read must not write into earlier ones."""
    path = tmp_path / "r.safetensors"
    first = big_record()
    write(path, first)
    got = format_read.read_file(path)
    other = Record({k: (v + 1 if v.size else v) for k, v in first.arrays.items()}, first.meta)
    write(path, Record({k: v.astype(first.arrays[k].dtype) for k, v in other.arrays.items()}, {}))
    again = format_read.read_file(path)
    assert_same(first, got)
    assert not mx.array_equal(again.arrays["c"], got.arrays["c"]).item()


def test_pmap_keeps_order_and_raises_the_first_error():
    items = list(range(200))
    assert digests.pmap(lambda x: x * x, items, nbytes=1 << 30) == [x * x for x in items]

    def boom(x):
        if x == 150:
            raise FormatError("piece 150")
        return x

    with pytest.raises(FormatError, match="piece 150"):
        digests.pmap(boom, items, nbytes=1 << 30)
    assert digests.pmap(lambda x: -x, items, nbytes=1 << 30)[:3] == [0, -1, -2]  # pool reusable


EXIT_RIGHT_AFTER_A_GET = """
import sys
import mlxcache
from helpers import blob_record
from mlxcache.records import reader as format_read
format_read.PIECEWISE_MIN_BYTES = 0  # the stand-in path, whose loads end on MLX's threads
b = mlxcache.open_backend(sys.argv[1])
b.put("k", blob_record(100))
assert b.get("k") is not None
"""


def test_a_process_that_exits_right_after_a_get_exits_cleanly(tmp_path):
    """MLX's I/O threads drop the stand-in file a moment after a read; a process exiting in
    that moment used to abort ("terminate called without an active exception", exit 134)
    about one time in ten on a busy machine. Many at once, so the machine is busy."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{TESTS}"}
    codes = []
    for batch in range(4):
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", EXIT_RIGHT_AFTER_A_GET, f"file://{tmp_path}/c{batch}{i}"],
                env=env,
                stderr=subprocess.PIPE,
            )  # fmt: skip
            for i in range(6)
        ]
        codes += [(p.wait(timeout=120), p.stderr.read().decode()[-500:]) for p in procs]
    assert [c for c in codes if c[0] != 0] == []
