"""A request's prompt KV cache on its way from a prefill rank to a decode rank: export from the
prefill rank's paged cache, the transports, and import into the decode rank's reserved blocks.

Legend (kernels/__init__.py): L layers, T prompt tokens, C latent width, NB cache blocks,
BS block size. The payload (engine.messages.KVPayload) is one tensor [L, T, C]. On Ray it
travels as an object: the prefill call returns it as a separate object ref that the router hands,
unopened, to the decode call, so the bytes move between the two ranks' object stores, never
through the router.
"""

from typing import Any, Protocol

import torch

from engine.messages import KVPayload
from kernels.mla_attention import cache_slot, gather_latent


class KVTransferError(RuntimeError):
    """The KV cache of a request could not be moved to its decode rank."""


class KVTransport(Protocol):
    """How a prompt's KV goes from the prefill rank to the decode rank. `send` runs on the
    prefill rank and returns a handle that the router passes on unopened; `receive` runs on the
    decode rank with that handle."""

    def send(self, payload: KVPayload, dst: int) -> Any:
        """dst: the decode rank's index in the transport's group (if it has one)."""
        ...

    def receive(self, handle: Any) -> KVPayload: ...

    def discard(self, handle: Any) -> None:
        """Take delivery of a transfer whose request ended before its decode started (a
        point-to-point send must be matched, or it times out and breaks the link)."""
        ...


class ObjectStoreTransport:
    """Over Ray's object store: the prefill call returns the payload as an object of its own,
    the router hands the object ref to the decode call, and Ray resolves it there, copying the
    bytes from the prefill node's store. Works on any Ray cluster; nothing to do on either side."""

    def send(self, payload: KVPayload, dst: int = 0) -> KVPayload:
        return payload

    def receive(self, handle: KVPayload) -> KVPayload:
        if not isinstance(handle, KVPayload):
            raise KVTransferError(f"expected a KV payload, got {type(handle).__name__}")
        return handle

    def discard(self, handle: Any) -> None:
        """Nothing to do: Ray frees the object when its last reference goes."""


def kv_bytes_per_token(num_layers: int, width: int, dtype: torch.dtype) -> int:
    """MLA: layers x (kv_lora_rank + qk_rope_head_dim) x dtype size."""
    return num_layers * width * torch.empty((), dtype=dtype).element_size()


def export_kv(
    kv_caches: list[torch.Tensor], block_table: list[int], num_tokens: int
) -> torch.Tensor:
    """The first num_tokens cached rows of a request, every layer -> [L, T, C] on the CPU."""
    table = torch.tensor(block_table, dtype=torch.long, device=kv_caches[0].device)
    return torch.stack([gather_latent(cache, table, num_tokens) for cache in kv_caches]).cpu()


def import_kv(
    kv_caches: list[torch.Tensor], block_table: list[int], data: torch.Tensor, start: int
) -> None:
    """Write rows start .. T-1 of data [L, T, C] into the request's blocks (rows before `start`
    are already there: prefix-cached blocks, shared with other requests, are left untouched).

    NOTE: the main model's layers come first on both sides; one more is the MTP layer's, on a
    rank that speculates (engine/speculative.py). From a prefill rank without it, a speculating
    decode rank's MTP layer keeps no rows for the prompt (its drafts miss more, its tokens stay
    the same); a decode rank without it drops that layer."""
    num_layers, num_tokens, width = data.shape
    assert abs(num_layers - len(kv_caches)) <= 1, (num_layers, len(kv_caches))
    assert width == kv_caches[0].shape[-1], data.shape
    block_size = kv_caches[0].shape[1]
    device = kv_caches[0].device
    pos = torch.arange(start, num_tokens, device=device)
    table = torch.tensor(block_table, dtype=torch.long, device=device)
    slots = cache_slot(table, pos, block_size)  # [T - start]
    for cache, rows in zip(kv_caches, data):
        cache.view(-1, width)[slots] = rows[start:].to(device=device, dtype=cache.dtype)
