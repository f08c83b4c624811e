"""The key of one block's KV in the tiers below the paged cache.

A block's latent rows depend on its whole prefix (the chained block hash), on the weights that
computed them (the model fingerprint), on the dtype they are stored in, and on the block size and
layer count that give them their shape: a key carries all of these, so a block written by another
model, dtype or block size is never read back as this one.
"""

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from engine.block_manager import block_hashes
from moe.config import ModelConfig

_FIXED = struct.Struct("<16sIIB")  # model fingerprint, block_size, num_layers, len(dtype)


def model_fingerprint(config: ModelConfig, checkpoint: str) -> bytes:
    """16 bytes that change with the model's config or its checkpoint (a path, a preset name, or
    a path plus a revision).

    NOTE: new weights written over the same path without a new revision in `checkpoint` keep the
    fingerprint: a deployment that retrains in place must add the revision.
    """
    described = json.dumps({"config": asdict(config), "checkpoint": checkpoint}, sort_keys=True)
    return hashlib.blake2b(described.encode(), digest_size=16).digest()


@dataclass(frozen=True, slots=True)
class KeySpace:
    """What every block of one served model on one rank shares: the key minus the block hash."""

    model: bytes  # model_fingerprint(...)
    dtype: str  # torch dtype name of the cached rows: "bfloat16", "float32", ...
    block_size: int
    num_layers: int

    def __post_init__(self) -> None:
        assert len(self.model) == 16, len(self.model)
        assert self.block_size >= 1 and self.num_layers >= 1, (self.block_size, self.num_layers)
        assert self.dtype and len(self.dtype.encode()) < 256, self.dtype

    def key(self, block_hash: bytes) -> "BlockKey":
        return BlockKey(self, block_hash)

    def keys(self, token_ids: Sequence[int]) -> list["BlockKey"]:
        """The keys of the full blocks of token_ids, in order (block_manager.block_hashes)."""
        return [self.key(h) for h in block_hashes(token_ids, self.block_size)]


@dataclass(frozen=True, slots=True)
class BlockKey:
    space: KeySpace
    block_hash: bytes  # 16 bytes, engine.block_manager.block_hashes

    def __post_init__(self) -> None:
        assert len(self.block_hash) == 16, len(self.block_hash)

    def to_bytes(self) -> bytes:
        """The canonical encoding (block files carry it in their header)."""
        s = self.space
        dtype = s.dtype.encode()
        return (
            self.block_hash + _FIXED.pack(s.model, s.block_size, s.num_layers, len(dtype)) + dtype
        )

    @classmethod
    def from_bytes(cls, raw: bytes) -> "BlockKey | None":
        """The key encoded in raw, or None if raw is not one (a foreign or damaged header)."""
        if len(raw) < 16 + _FIXED.size:
            return None
        model, block_size, num_layers, n = _FIXED.unpack_from(raw, 16)
        if len(raw) != 16 + _FIXED.size + n or block_size < 1 or num_layers < 1 or n < 1:
            return None
        try:
            dtype = raw[16 + _FIXED.size :].decode()
        except UnicodeDecodeError:
            return None
        return cls(KeySpace(model, dtype, block_size, num_layers), raw[:16])

    @property
    def name(self) -> str:
        """A file name: 32 hex digits over the whole key (two keys differing anywhere differ)."""
        return hashlib.blake2b(self.to_bytes(), digest_size=16).hexdigest()
