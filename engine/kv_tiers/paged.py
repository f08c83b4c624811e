"""Moving whole blocks between a rank's paged cache and the tiers: the two copies the engine will
call (docs/kv_tiers.md, "How it is wired"), kept here so they are tested before the wiring.

Legend (kernels/__init__.py): L layers, NB cache blocks, BS block size, C latent width, n blocks
moved. The paged cache is L x [NB, BS, C]; a tier block is [L, BS, C] on the CPU.
"""

import torch


def blocks_out(kv_caches: list[torch.Tensor], block_ids: list[int]) -> list[torch.Tensor]:
    """The rows of the paged blocks block_ids, one CPU tensor [L, BS, C] per block (copies: the
    paged blocks may be reused as soon as this returns)."""
    if not block_ids:
        return []
    ids = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0].device)
    # One gather per layer for all the blocks, one device-to-host copy.
    stacked = torch.stack(
        [cache.index_select(0, ids) for cache in kv_caches], dim=1
    )  # [n, L, BS, C]
    # NOTE: a clone each: a view would keep the whole batch's storage alive in a tier that
    # counts one block's bytes.
    return [kv.clone() for kv in stacked.cpu().unbind(0)]


def blocks_in(
    kv_caches: list[torch.Tensor], block_ids: list[int], blocks: list[torch.Tensor]
) -> None:
    """Write blocks (each [L, BS, C], from a tier) into the paged blocks block_ids, in order."""
    assert len(block_ids) == len(blocks), (len(block_ids), len(blocks))
    if not block_ids:
        return
    data = torch.stack(blocks, dim=1)  # [L, n, BS, C]
    assert data.shape[0] == len(kv_caches) and data.shape[2:] == kv_caches[0].shape[1:], data.shape
    ids = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0].device)
    for cache, rows in zip(kv_caches, data, strict=True):
        cache.index_copy_(0, ids, rows.to(device=cache.device, dtype=cache.dtype))
