"""``file://``: one safetensors file per record and a SQLite index shared by processes.

``backend`` (DiskBackend: gets, puts, eviction), ``index`` (the SQLite schema and queries),
``writes`` (stage, sync, publish) and ``files`` (durable file primitives, writer liveness). It
may import the backend base, records, options and errors.
"""

from mlxcache.backends.disk.backend import DiskBackend, from_uri

__all__ = ["DiskBackend", "from_uri"]
