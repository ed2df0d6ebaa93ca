"""Record signing: a secret turns every record's checksum into a MAC bound to its cache key.

A :class:`Signer` holds the current secret (new records are signed with it) and any old ones
still accepted (secret rotation). The MAC is keyed BLAKE3 (about twice the speed of
HMAC-SHA256 here, see docs/performance.md); the MAC key and a public 16-hex key id are derived
from each secret with BLAKE3's key derivation, so the record names which secret signed it and
the secret itself never appears anywhere. The format layer (:mod:`mlxcache.records.format`) computes
and checks the MAC; backends only pass the signer through.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import blake3

ENV_SECRET = "MLXCACHE_SECRET"
OLD_SUFFIX = "_OLD"  # MLXCACHE_SECRET_OLD: comma-separated secrets still accepted on read
MIN_SECRET_CHARS = 16
MAC_ALGO = "blake3"
_MAC_CONTEXT = "mlxcache 2026 record MAC v1"
_ID_CONTEXT = "mlxcache 2026 key id v1"


def _as_bytes(secret: str | bytes, what: str) -> bytes:
    if isinstance(secret, str):
        secret = secret.encode("utf-8")
    if not isinstance(secret, bytes):
        raise TypeError(f"{what} must be a str or bytes")
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"{what} is too short: use at least {MIN_SECRET_CHARS} characters")
    return secret


class Signer:
    """Signs with ``secret``; verifies records signed with it or any of ``old``.

    ``repr`` shows key ids only. Secrets shorter than 16 characters are refused (ValueError,
    naming ``what``, never the value).
    """

    def __init__(
        self, secret: str | bytes, old: Iterable[str | bytes] = (), *, what: str = "secret"
    ) -> None:
        keys: dict[str, bytes] = {}
        current = ""
        for i, s in enumerate([secret, *old]):
            raw = _as_bytes(s, what if i == 0 else f"old {what} #{i}")
            key_id = blake3.blake3(raw, derive_key_context=_ID_CONTEXT).hexdigest()[:16]
            keys.setdefault(key_id, blake3.blake3(raw, derive_key_context=_MAC_CONTEXT).digest())
            current = current or key_id
        self.key_id = current
        self._keys = keys

    @property
    def accepted(self) -> tuple[str, ...]:
        """Key ids whose records verify (the current one first)."""
        return tuple(self._keys)

    def hasher(self, key_id: str | None = None) -> blake3.blake3 | None:
        """A fresh keyed hasher for ``key_id`` (default: the current secret), None if unknown."""
        mac_key = self._keys.get(self.key_id if key_id is None else key_id)
        return None if mac_key is None else blake3.blake3(key=mac_key)

    def __repr__(self) -> str:
        return f"Signer(key_id={self.key_id!r}, accepted={len(self._keys)})"

    __str__ = __repr__


def from_env(name: str = ENV_SECRET, *, required: bool = False) -> Signer | None:
    """The signer configured by ``$name`` (and ``$name_OLD``), or None when ``$name`` is unset.

    ``required=True`` (a URI's ``secret_env=NAME``) makes an unset or empty variable a
    ValueError: a cache asked to be signed never silently runs unsigned.
    """
    if not isinstance(name, str) or not name:
        raise ValueError("secret_env must name an environment variable")
    secret = os.environ.get(name, "")
    old = [s.strip() for s in os.environ.get(name + OLD_SUFFIX, "").split(",") if s.strip()]
    if not secret:
        if required:
            raise ValueError(f"secret_env={name}: the environment variable {name} is not set")
        if old:
            raise ValueError(f"{name}{OLD_SUFFIX} is set but {name} is not")
        return None
    return Signer(secret, old, what=f"${name}")


def resolve(secret_env: str | None) -> Signer | None:
    """The signer of a backend: ``secret_env=NAME`` when given, else ``$MLXCACHE_SECRET``."""
    if secret_env is None:
        return from_env(ENV_SECRET)
    return from_env(secret_env, required=True)


__all__ = ["ENV_SECRET", "MAC_ALGO", "Signer", "from_env", "resolve"]
