"""The record layer: a ``Record`` (MLX arrays plus plain metadata) and its bytes.

``record`` (the Record), ``meta`` (msgpack metadata, plain data only), ``digests`` (checksums and
MACs of pieces), ``signing`` (keys for MACs), ``format`` (Record <-> safetensors bytes or file) and
``reader`` (record files -> verified Records). Below the backends: it imports only ``errors``.
"""

from mlxcache.records.record import Record

__all__ = ["Record"]
