"""Small blocks for the tier tests: L = 2 layers, BS = 4 tokens, C = 3 numbers, float32, so one
block is 2 * 4 * 3 * 4 = 96 bytes of payload."""

import torch

from engine.kv_tiers.key import BlockKey, KeySpace

L, BS, C = 2, 4, 3
BLOCK_BYTES = L * BS * C * 4


SPACE = KeySpace(model=b"m" * 16, dtype="float32", block_size=BS, num_layers=L)


def block(i: int) -> torch.Tensor:
    """Block i's rows [L, BS, C]: distinct values per block."""
    return torch.arange(L * BS * C, dtype=torch.float32).view(L, BS, C) + 1000 * i


def key(i: int, space: KeySpace = SPACE) -> BlockKey:
    """Block i's key (a stand-in block hash: i in 16 bytes)."""
    return space.key(i.to_bytes(16, "little"))
