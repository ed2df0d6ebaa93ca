"""Exceptions shared by the serializers and backends."""


class FormatError(ValueError):
    """Stored bytes are not a readable mlxcache record (corrupt, truncated or foreign)."""


class UnsupportedVersionError(FormatError):
    """A record written by a newer (or unknown) mlxcache format version."""


class UntrustedRecordError(FormatError):
    """A record without a valid MAC for this cache's secret: unsigned, forged, replayed from
    another key, or signed with a secret this reader does not accept."""


class RecordTooLargeError(ValueError):
    """A record whose header (metadata and tensor table) is over the format's size limit."""
