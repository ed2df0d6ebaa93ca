"""Compact prefix sketches of token ids, for the MLLM manager's per-images index lines.

An index line used to hold every token id (8 bytes a token), so a group of long prompts could
pass the record size cap and every store rewrote megabytes. A sketch keeps the first
``HEAD`` token ids and one chained 8-byte digest per ``BLOCK`` tokens after them: over 50x
smaller. It only ranks candidates; every candidate is verified against its stored tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash

HEAD = 64  # token ids kept verbatim: short common prefixes are measured exactly
BLOCK = 64  # tokens per chained digest after the head
_DIGEST = 8


@dataclass(frozen=True)
class Sketch:
    """A prompt's length, its first token ids and chained digests of its later whole blocks."""

    length: int
    head: bytes
    blocks: bytes

    def as_fields(self) -> dict[str, object]:
        """The index-line fields of this sketch (msgpack-able)."""
        return {"len": self.length, "head": self.head, "blocks": self.blocks}


def sketch(tokens: np.ndarray) -> Sketch:
    """The sketch of flat int64 token ids."""
    tokens = np.ascontiguousarray(tokens, dtype=np.int64)
    digests = bytearray()
    prev = b""
    for start in range(HEAD, len(tokens) - BLOCK + 1, BLOCK):
        prev = xxhash.xxh3_64_digest(prev + tokens[start : start + BLOCK].tobytes())
        digests += prev
    return Sketch(len(tokens), tokens[:HEAD].tobytes(), bytes(digests))


def from_fields(item: dict) -> Sketch | None:
    """The sketch an index line holds, or None when its fields are malformed."""
    length, head, blocks = item.get("len"), item.get("head"), item.get("blocks")
    if not (isinstance(length, int) and isinstance(head, bytes) and isinstance(blocks, bytes)):
        return None
    if length < 0 or len(head) % 8 or len(head) // 8 != min(length, HEAD):
        return None
    if len(blocks) != _DIGEST * max(0, (length - HEAD) // BLOCK):
        return None
    return Sketch(length, head, blocks)


def match_bound(stored: Sketch, request: Sketch) -> int:
    """An upper bound of the common prefix of the two prompts (exact below ``HEAD`` tokens).

    Zero means they share no first token, so the stored entry need not be loaded at all.
    """
    a = np.frombuffer(stored.head, dtype=np.int64)
    b = np.frombuffer(request.head, dtype=np.int64)
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    if len(diff) or n < HEAD:
        return int(diff[0]) if len(diff) else n
    same = 0  # leading whole blocks with equal chained digests
    for i in range(0, min(len(stored.blocks), len(request.blocks)), _DIGEST):
        if stored.blocks[i : i + _DIGEST] != request.blocks[i : i + _DIGEST]:
            break
        same += 1
    return min(stored.length, request.length, HEAD + (same + 1) * BLOCK)
