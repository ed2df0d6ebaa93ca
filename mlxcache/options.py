"""Typed options from a URI query string or keyword arguments, with clear errors."""

from __future__ import annotations

import builtins
import re
from typing import Any, overload
from urllib.parse import urlsplit

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}  # fmt: skip
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int | float) -> int:
    """``512MiB``, ``2GiB``, ``1.5GB``, ``1024`` or an int -> bytes."""
    if isinstance(value, bool):
        raise ValueError(f"invalid size {value!r}")
    if isinstance(value, int | float):
        if not 0 <= value < float("inf"):  # also refuses NaN
            raise ValueError(f"invalid size {value!r}: must be a finite number >= 0")
        return int(value)
    m = _SIZE.match(str(value))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(
            f"invalid size {value!r}: use bytes or a number with a unit "
            "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 512MiB or 1.5GB"
        )
    size = float(m.group(1)) * _UNITS[unit]
    if size == float("inf"):
        raise ValueError(f"invalid size {value!r}: too large")
    return int(size)


_SENSITIVE = re.compile(r"pass|secret|token|credential|auth", re.IGNORECASE)


def is_sensitive(name: str) -> bool:
    """Whether an option's value must never be shown (``password``, ``token``...).

    ``secret_env`` names a variable, not a secret, so it is shown.
    """
    return bool(_SENSITIVE.search(name)) and not name.lower().endswith("_env")


def redact_uri(uri: str) -> str:
    """``uri`` fit to print: ``user:***@host``, sensitive query values as ``***``."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return "<unparseable URI>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:***@{host}" if colon else f"{userinfo}@{host}"
    query = "&".join(
        f"{k}=***" if is_sensitive(k) and sep else f"{k}{sep}{v}"
        for k, sep, v in (item.partition("=") for item in parts.query.split("&") if item)
    )
    text = f"{parts.scheme}://{netloc}{parts.path}" if parts.scheme else f"{netloc}{parts.path}"
    return text + (f"?{query}" if query else "")


class Options:
    """Takes named options one by one; :meth:`done` rejects any that nobody took."""

    def __init__(self, scheme: str, values: dict[str, Any]) -> None:
        self.scheme = scheme
        self.values = dict(values)
        self.known: list[str] = []

    def _take(self, name: str, default: Any, convert) -> Any:
        self.known.append(name)
        if name not in self.values or self.values[name] is None:
            self.values.pop(name, None)
            return default
        raw = self.values.pop(name)
        try:
            return convert(raw)
        except (TypeError, ValueError) as exc:
            if is_sensitive(name):
                raise ValueError(f"{self.scheme}:// option {name}=*** is invalid") from None
            raise ValueError(f"{self.scheme}:// option {name}={raw!r} is invalid: {exc}") from None

    def size(self, name: str, default: int | None) -> int | None:
        return self._take(name, default, parse_size)

    def int(self, name: str, default: int | None, minimum: int = 0) -> int | None:
        def convert(v: Any) -> int:
            n = int(v)
            if n < minimum:
                raise ValueError(f"must be >= {minimum}")
            return n

        return self._take(name, default, convert)

    @overload
    def float(self, name: str, default: float, minimum: float = 0.0) -> float: ...
    @overload
    def float(
        self, name: str, default: builtins.float | None, minimum: builtins.float = 0.0
    ) -> builtins.float | None: ...
    def float(
        self, name: str, default: builtins.float | None, minimum: builtins.float = 0.0
    ) -> builtins.float | None:
        def convert(v: Any) -> float:
            x = float(v)
            if not x >= minimum:
                raise ValueError(f"must be >= {minimum}")
            return x

        return self._take(name, default, convert)

    def str(self, name: str, default: str | None) -> str | None:
        return self._take(name, default, str)

    def bool(self, name: builtins.str, default: bool) -> bool:
        def convert(v: Any) -> bool:
            if isinstance(v, bool):
                return v
            text = str(v).lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError("use true or false")

        return self._take(name, default, convert)

    def done(self) -> None:
        if self.values:
            unknown = ", ".join(sorted(self.values))
            valid = ", ".join(sorted(self.known)) or "none"
            raise ValueError(
                f"unknown option(s) for {self.scheme}://: {unknown}; valid options: {valid}"
            )
