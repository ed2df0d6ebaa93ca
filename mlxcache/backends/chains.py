"""The optional chain-walk capability: a prefix lookup a backend may answer in one round trip.

``ChainWalk`` says what to walk and read without naming tokens or models; a backend that can
(Redis, one server) implements ``walk_chain``/``add_sibling`` and everyone else is asked
through ``contains_many`` + ``get_many`` by the caller. docs/backends.md, "Chain walks".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxcache.protocol import CacheBackend
from mlxcache.records.record import Record

MAX_MEMBERS = 16  # keys of one sibling index entry


@dataclass(frozen=True)
class ChainWalk:
    """One chain lookup a backend may answer in one round trip (docs/backends.md, "Chain walks").

    Walk ``chain`` in order while present: ``k`` keys found. ``aligned`` is the largest
    ``i <= k`` with ``marks[i - 1]`` present. The candidate: when ``k == len(chain)``, the
    first of ``ends`` (key lists, longest first) whose first key is present; else, among the
    entries of sibling index ``siblings[k]`` (see ``add_sibling``) whose label is a shorter
    prefix, in whole ``unit``-byte units, of ``labels[k * label_size:(k + 1) * label_size]``,
    the longest whose first key is present. Then read ``chain[:k]``, the candidate's keys (or,
    with none, ``marks[aligned - 1]``) and the present ``extras``.
    """

    chain: list[str]
    marks: list[str]
    siblings: list[str]
    labels: bytes
    label_size: int
    unit: int
    ends: list[list[str]]
    extras: list[str]


@dataclass
class ChainFound:
    """What a walk found: ``rank`` is 1 + the index in ``ends`` when ``k == len(chain)``, else
    the candidate label's length in units (0: no candidate); ``members`` its keys;
    ``records`` in the read order of :class:`ChainWalk` (None for a miss)."""

    k: int = 0
    rank: int = 0
    members: list[str] = field(default_factory=list)
    aligned: int = 0
    extras: list[bool] = field(default_factory=list)
    records: list[Record | None] = field(default_factory=list)


def walks_chains(backend: CacheBackend) -> bool:
    """Whether ``walk_chain`` may answer on this backend (so a caller builds the walk at all)."""
    if not callable(getattr(backend, "walk_chain", None)):
        return False
    return bool(getattr(backend, "walks_chains", True))


def walk_chain(backend: CacheBackend, walk: ChainWalk) -> ChainFound | None:
    """``backend.walk_chain(walk)`` if the backend has the capability, else None: the caller
    then does the walk itself with ``contains_many`` and ``get_many`` (the protocol default)."""
    fn = getattr(backend, "walk_chain", None)
    return fn(walk) if callable(fn) else None


def add_sibling(backend: CacheBackend, index: str, label: bytes, members: list[str]) -> None:
    """Register ``members`` under ``label`` in sibling index ``index`` where the backend keeps
    sibling indexes (for ``walk_chain``); elsewhere nothing."""
    fn = getattr(backend, "add_sibling", None)
    if callable(fn):
        fn(index, label, members)
