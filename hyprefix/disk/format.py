"""The file format of the disk tier's block files (``store.py`` keeps them): one block's bytes
under a header that names what they are valid for.

File format (little-endian), a header then the payload::

    magic b"HYPXBLK1" | version u16 (= 1) | header length u32 | payload length u64 |
    payload CRC32 u32 | block hash 32 B | kind 16 B (NUL-padded ASCII) |
    model length u32 | model utf-8 | layout length u32 | layout utf-8 | header CRC32 u32

(the header CRC covers every header byte before it). Every read checks all of it, each failure
under its own reason: ``magic``, ``version``, ``length`` (file size != header + payload, i.e.
truncated or extended, or too short for the fixed fields), ``header_crc``, ``key`` (hash or kind
differ from the file name: renamed or copied), ``identity`` (model or layout differ),
``payload_crc``, and ``io`` (an OSError other than a missing file). A file that fails is
*refused*: deleted, counted under its reason, dropped from the index, returned as a miss. A bad
file never raises.
"""

from __future__ import annotations

import hashlib
import re
import struct
import zlib
from dataclasses import dataclass
from typing import BinaryIO

MAGIC = b"HYPXBLK1"
FORMAT_VERSION = 1
HASH_SIZE = 32
KIND_SIZE = 16

# magic, format version, header length, payload length, payload CRC32, block hash, kind (NUL-padded);
# then model and layout (each a uint32 length + utf-8), then the CRC32 of all header bytes before it.
FIXED_HEADER = struct.Struct(f"<8sHIQI{HASH_SIZE}s{KIND_SIZE}s")
U32 = struct.Struct("<I")
_MIN_HEADER = FIXED_HEADER.size + 3 * U32.size  # two empty strings and the header CRC
_KIND_RE = re.compile(rf"[a-z0-9_]{{1,{KIND_SIZE}}}")
# a block file's name: the hash in lowercase hex, a dot, the kind (temp files never match)
_NAME_RE = re.compile(rf"([0-9a-f]{{{2 * HASH_SIZE}}})\.([a-z0-9_]{{1,{KIND_SIZE}}})")

Key = tuple[str, bytes]


@dataclass(frozen=True)
class DiskIdentity:
    """What the files of a store are only valid for. ``model`` names the model (and its weights);
    ``layout`` is the caller's free-form description of the payload layout (dtype, block size,
    tensor shapes): a change to either means the old bytes are not interchangeable with the new."""

    model: str
    layout: str

    def __post_init__(self) -> None:
        if "\0" in self.model:  # the directory name hashes model "\0" layout: keep it unambiguous
            raise ValueError("the model identity must not contain NUL")

    @property
    def dirname(self) -> str:
        digest = hashlib.blake2b(f"v{FORMAT_VERSION}\0{self.model}\0{self.layout}".encode(), digest_size=8)
        return digest.hexdigest()


class Refused(Exception):
    """A file that fails validation; ``inode`` names the file judged, where it was opened."""

    def __init__(self, reason: str, inode: tuple[int, int] | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.inode = inode


def encode_header(identity_tail: bytes, kind: str, block_hash: bytes, payload_len: int,
                   payload_crc: int) -> bytes:
    """``identity_tail``: the encoded model and layout strings (``encode_identity``)."""
    header_len = FIXED_HEADER.size + len(identity_tail) + U32.size
    head = FIXED_HEADER.pack(MAGIC, FORMAT_VERSION, header_len, payload_len, payload_crc, block_hash,
                       kind.encode("ascii")) + identity_tail
    return head + U32.pack(zlib.crc32(head))


def encode_identity(identity: DiskIdentity) -> bytes:
    model, layout = identity.model.encode(), identity.layout.encode()
    return U32.pack(len(model)) + model + U32.pack(len(layout)) + layout


def check_key(kind: str, block_hash: bytes) -> Key:
    if not isinstance(kind, str) or _KIND_RE.fullmatch(kind) is None:
        raise ValueError(f"kind must match [a-z0-9_]{{1,16}}, got {kind!r}")
    if not isinstance(block_hash, bytes) or len(block_hash) != HASH_SIZE:
        raise ValueError(f"block_hash must be {HASH_SIZE} bytes, got {block_hash!r}")
    return kind, block_hash


def parse_name(name: str) -> Key | None:
    """``<64 lowercase hex>.<kind>`` -> key, or None for anything else (temp files included)."""
    match = _NAME_RE.fullmatch(name)
    return None if match is None else (match[2], bytes.fromhex(match[1]))


def read_payload(f: BinaryIO, identity_tail: bytes, file_size: int, key: Key) -> bytes:
    """The payload of an open block file after every check of its header (``Refused`` names the failed one)."""
    fixed = f.read(FIXED_HEADER.size)
    if len(fixed) < FIXED_HEADER.size:
        raise Refused("length")
    magic, version, header_len, payload_len, payload_crc, block_hash, kind = FIXED_HEADER.unpack(fixed)
    if magic != MAGIC:
        raise Refused("magic")
    if version != FORMAT_VERSION:
        raise Refused("version")
    if header_len < _MIN_HEADER or header_len + payload_len != file_size:
        raise Refused("length")
    rest = f.read(header_len - FIXED_HEADER.size)
    if len(rest) != header_len - FIXED_HEADER.size:
        raise Refused("length")
    (header_crc,) = U32.unpack_from(rest, len(rest) - U32.size)
    if zlib.crc32(rest[:-U32.size], zlib.crc32(fixed)) != header_crc:
        raise Refused("header_crc")
    if block_hash != key[1] or kind.rstrip(b"\0") != key[0].encode("ascii"):
        raise Refused("key")
    if rest[:-U32.size] != identity_tail:
        raise Refused("identity")
    payload = f.read(payload_len)
    if len(payload) != payload_len:
        raise Refused("length")
    if zlib.crc32(payload) != payload_crc:
        raise Refused("payload_crc")
    return payload
