"""One block's KV on disk: a header that says exactly what the payload is, then the payload.

Layout (little-endian):
    magic b"EPKVBLK\\0" | version u16 | key length u16 | key (BlockKey.to_bytes())
    | L u32 | BS u32 | C u32 | payload length u64 | blake2b-16 of the payload | payload [L, BS, C]

A reader trusts nothing: a torn, truncated, foreign (another key's) or corrupt file is a miss and
is removed, so the next writer of that block replaces it. Writers write a temporary name in the
same directory and rename it over the final one: a reader sees a whole file or none, and
concurrent writers of one block leave one of their (identical) files.
"""

import hashlib
import logging
import os
import struct
import threading
import uuid

import torch

from engine.kv_tiers.key import BlockKey

log = logging.getLogger(__name__)

MAGIC = b"EPKVBLK\0"
VERSION = 1
TMP_SUFFIX = ".tmp"
_HEAD = struct.Struct("<8sHH")  # magic, version, key length
_BODY = struct.Struct("<IIIQ16s")  # L, BS, C, payload length, checksum


def _checksum(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


def encode(key: BlockKey, kv: torch.Tensor) -> bytes:
    """The file's bytes for kv [L, BS, C] (CPU, dtype key.space.dtype)."""
    space = key.space
    assert kv.dim() == 3 and kv.device.type == "cpu", (kv.shape, kv.device)
    assert kv.shape[0] == space.num_layers and kv.shape[1] == space.block_size, kv.shape
    assert str(kv.dtype).removeprefix("torch.") == space.dtype, (kv.dtype, space.dtype)
    # NOTE: a uint8 view, not numpy of the tensor: numpy has no bfloat16.
    payload = kv.contiguous().view(torch.uint8).numpy().tobytes()
    raw_key = key.to_bytes()
    head = _HEAD.pack(MAGIC, VERSION, len(raw_key))
    body = _BODY.pack(*kv.shape, len(payload), _checksum(payload))
    return head + raw_key + body + payload


def decode(key: BlockKey, data: bytes) -> torch.Tensor | None:
    """The tensor [L, BS, C] in data if data is a whole, intact file of exactly this key."""
    if len(data) < _HEAD.size:
        return None
    magic, version, key_len = _HEAD.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        return None
    at = _HEAD.size
    if BlockKey.from_bytes(data[at : at + key_len]) != key:  # foreign or damaged key
        return None
    at += key_len
    if len(data) < at + _BODY.size:
        return None
    num_layers, block_size, width, length, checksum = _BODY.unpack_from(data, at)
    at += _BODY.size
    dtype = getattr(torch, key.space.dtype, None)
    if not isinstance(dtype, torch.dtype) or width < 1:
        return None
    shape = (num_layers, block_size, width)
    if shape[:2] != (key.space.num_layers, key.space.block_size):
        return None
    itemsize = torch.empty((), dtype=dtype).element_size()
    if length != num_layers * block_size * width * itemsize or len(data) != at + length:
        return None
    payload = memoryview(data)[at:]
    if _checksum(payload) != checksum:
        return None
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).view(shape)


def file_size(key: BlockKey, kv: torch.Tensor) -> int:
    """The bytes encode(key, kv) takes, without encoding it."""
    return _HEAD.size + len(key.to_bytes()) + _BODY.size + kv.numel() * kv.element_size()


def read(path: str, key: BlockKey) -> torch.Tensor | None:
    """The block at path, or None (a missing file; or a bad one, which is then removed).

    Never raises: an unreadable file is a miss like a missing one.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    kv = decode(key, data)
    if kv is None:
        log.info("kv_tiers: removing a torn, foreign or corrupt block file %s", path)
        remove(path)
    return kv


def write(path: str, key: BlockKey, kv: torch.Tensor) -> int:
    """Write kv [L, BS, C] to path atomically; -> bytes written. Raises OSError (a full disk,
    an unwritable directory): the caller decides what that means for its tier."""
    data = encode(key, kv)
    # Unique per process and thread, so concurrent writers never share a temporary file.
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.{uuid.uuid4().hex[:8]}{TMP_SUFFIX}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:  # os.write may write less than asked
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        remove(tmp)
        raise
    return len(data)


def remove(path: str) -> None:
    """Remove path if it is there (another rank may have removed it first)."""
    try:
        os.remove(path)
    except OSError:
        pass
