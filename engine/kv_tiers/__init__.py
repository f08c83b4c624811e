"""KV tiers below a rank's paged cache: host memory and a disk directory, content-addressed by
the prefix cache's chained block hash (docs/kv_tiers.md).

- key.py: BlockKey, the identity of one block's KV (block hash, model, dtype, block size, layers).
- block_file.py: one block on disk (a checked header, then the payload).
- host.py, disk.py: the two tiers, each LRU within a byte budget.
- store.py: TieredStore, the write-back front over both (a background writer thread).
- stats.py: TierStats, the counters of one tier (metric-ready).

Legend (kernels/__init__.py): L layers, BS block size, C latent width. A block's KV is one
tensor [L, BS, C] on the CPU.
"""
