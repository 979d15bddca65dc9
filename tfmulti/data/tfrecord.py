"""TFRecord files checked before training: each record's framing (its
length and the length's checksum) read in Python, so a file cut off or
damaged is named, with the byte offset, before the first epoch.

TensorFlow's reader fails mid-epoch on a record cut in the middle
(`DataLossError`, without the file's name), and treats a file that ends
inside a record's 12-byte header as complete: the records after the cut are
silently gone. `scan` reads 12 bytes per record and seeks over the payload,
so it costs little next to an epoch (a compressed file is decompressed once).
The payloads' own checksums are left to TensorFlow's reader.

Example:
    >>> import os, tempfile
    >>> import tensorflow as tf
    >>> from tfmulti.data import tfrecord
    >>> path = os.path.join(tempfile.mkdtemp(), "part-0.tfrecord")
    >>> with tf.io.TFRecordWriter(path) as writer:
    ...     for i in range(3):
    ...         writer.write(b"record %d" % i)
    >>> tfrecord.scan(path)
    Scan('part-0.tfrecord': 3 whole records)
    >>> with open(path, "r+b") as f:
    ...     _ = f.truncate(os.path.getsize(path) - 10)
    >>> tfrecord.scan(path).damage
    'the file ends inside record 2 (a record of 8 bytes needs 12 after its header; 2 are there)'
"""

from __future__ import annotations

import dataclasses
import os
import struct
import zlib

__all__ = ["COMPRESSIONS", "Scan", "masked_crc32c", "record_fails_at", "scan"]

COMPRESSIONS = ("", "GZIP", "ZLIB")
"""TFRecord compressions `scan` reads ("" or None: none), as TensorFlow names them."""
_HEADER = 12  # uint64 length, uint32 masked CRC32C of the length
_FOOTER = 4  # uint32 masked CRC32C of the payload
_CHUNK = 1 << 20


def _crc32c_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
        table.append(crc)
    return tuple(table)


_TABLE = _crc32c_table()


def masked_crc32c(data: bytes) -> int:
    """The masked CRC32C (Castagnoli) that TFRecord framing stores."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


@dataclasses.dataclass(frozen=True)
class Scan:
    """What `scan` found in one file.

    Attributes:
        path: the file.
        records: the whole records before the damage (all of them when intact).
        damage: what is wrong, None when the file is intact.
        offset: the byte offset of the damaged record (in the decompressed
            stream for a compressed file), None when intact.
        compressed: whether the file is compressed (GZIP, ZLIB).
    """

    path: str
    records: int
    damage: str | None = None
    offset: int | None = None
    compressed: bool = False

    @property
    def ok(self) -> bool:
        return self.damage is None

    def describe(self) -> str:
        """The damage in words: the file, the offset, what is wrong and what is whole."""
        if self.ok:
            return f"{self.path} holds {self.records} whole records"
        where = "byte offset" if not self.compressed else "byte offset (decompressed)"
        return (f"{self.path} is damaged at {where} {self.offset}: {self.damage}; the "
                f"{self.records} records before it are whole")

    def __repr__(self) -> str:
        name = os.path.basename(self.path)
        if self.ok:
            return f"Scan({name!r}: {self.records} whole records)"
        return f"Scan({name!r}: damaged at {self.offset}, {self.records} whole records before)"


class _Reader:
    """A file's (decompressed) bytes, read forward: `read` and `skip`."""

    def __init__(self, path: str, compression: str):
        self._file = open(path, "rb", buffering=_CHUNK)  # noqa: SIM115 (closed by close())
        self._compression = compression
        self._inflate = None
        self._pending = b""
        if compression == "GZIP":
            self._inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif compression == "ZLIB":
            self._inflate = zlib.decompressobj()
        self._size = os.fstat(self._file.fileno()).st_size

    def close(self) -> None:
        self._file.close()

    def read(self, n: int) -> bytes:
        if self._inflate is None:
            return self._file.read(n)
        while len(self._pending) < n and self._more():
            pass
        out, self._pending = self._pending[:n], self._pending[n:]
        return out

    def skip(self, n: int) -> int:
        """Skips up to `n` bytes; returns how many there were."""
        if self._inflate is None:
            start = self._file.tell()
            target = min(start + n, self._size)
            self._file.seek(target)
            return target - start
        skipped = 0
        while True:
            take = min(n - skipped, len(self._pending))
            self._pending = self._pending[take:]
            skipped += take
            if skipped == n or not self._more():
                return skipped

    def _more(self) -> bool:
        """Decompresses the next chunk into `_pending`; False at the end."""
        if self._inflate.eof:
            if not self._inflate.unused_data:
                return False
            # Another member (concatenated gzip files): a fresh decompressor.
            rest = self._inflate.unused_data
            self._inflate = zlib.decompressobj(16 + zlib.MAX_WBITS
                                               if self._compression == "GZIP" else zlib.MAX_WBITS)
            self._pending += self._inflate.decompress(rest)
            return True
        chunk = self._file.read(_CHUNK)
        if not chunk:
            if not self._inflate.eof:
                raise _StreamEnd()
            return False
        self._pending += self._inflate.decompress(chunk)
        return True


class _StreamEnd(Exception):
    """A compressed stream that ends before its end marker."""


def scan(path: str, compression: str | None = None) -> Scan:
    """Checks the framing of every record of the TFRecord file `path`.

    Args:
        path: the file.
        compression: "" or None (plain TFRecord), "GZIP" or "ZLIB".

    Returns:
        A `Scan`: the whole records, and where and how the file is damaged
        (a header whose checksum fails: not a TFRecord file, or damaged; a
        file or compressed stream that ends inside a record).

    Raises:
        OSError: the file cannot be read (missing, no permission, I/O error).
        ValueError: an unknown compression.
    """
    compression = (compression or "").upper()
    if compression not in COMPRESSIONS:
        raise ValueError(f"`compression` must be one of {list(COMPRESSIONS)} (or None), got "
                         f"{compression!r}.")
    reader = _Reader(path, compression)
    records = offset = 0

    def damaged(what: str) -> Scan:
        return Scan(path, records, what, offset, compressed=bool(compression))

    try:
        while True:
            header = reader.read(_HEADER)
            if not header:
                return Scan(path, records, compressed=bool(compression))
            if len(header) < _HEADER:
                return damaged(f"the file ends inside the header of record {records} "
                               f"({len(header)} of its {_HEADER} bytes are there)")
            length, crc = struct.unpack("<QI", header)
            if masked_crc32c(header[:8]) != crc:
                return damaged(f"the header of record {records} fails its checksum "
                               "(not a TFRecord file, or overwritten)")
            needed = length + _FOOTER
            there = reader.skip(needed)
            if there < needed:
                return damaged(f"the file ends inside record {records} (a record of {length} "
                               f"bytes needs {needed} after its header; {there} are there)")
            records += 1
            offset += _HEADER + needed
    except (_StreamEnd, EOFError):
        return damaged(f"the {compression} stream ends early, inside or after record "
                       f"{records}")
    except zlib.error as e:
        return damaged(f"the {compression} data cannot be decompressed ({e})")
    finally:
        reader.close()


def record_fails_at(path: str, offset: int) -> str | None:
    """What is wrong with the record of the plain TFRecord file `path` that
    TensorFlow's reader reports at byte `offset` ("corrupted record at N":
    the record's start for its header, the start + 12 for its payload), or
    None: no record of this file starts there, or it is whole. TensorFlow
    names the offset but not the file.

    Raises:
        OSError: the file cannot be read.
    """
    with open(path, "rb", buffering=_CHUNK) as f:
        start = 0
        while start < offset - _HEADER:  # walk the framing to the record there
            header = f.read(_HEADER)
            if len(header) < _HEADER:
                return None
            length, crc = struct.unpack("<QI", header)
            if masked_crc32c(header[:8]) != crc:
                return None
            start += _HEADER + length + _FOOTER
            f.seek(start)
        if start not in (offset, offset - _HEADER):
            return None
        header = f.read(_HEADER)
        if len(header) < _HEADER:
            return None
        length, crc = struct.unpack("<QI", header)
        if masked_crc32c(header[:8]) != crc:
            return "the record's header fails its checksum"
        payload, footer = f.read(length), f.read(_FOOTER)
        if len(payload) < length or len(footer) < _FOOTER:
            return "the file ends inside the record there"
        if masked_crc32c(payload) != struct.unpack("<I", footer)[0]:
            return f"the record's {length} bytes fail their checksum (changed since written)"
    return None
