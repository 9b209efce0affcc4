"""Reference (pure torch) scatter of new keys/values into the paged KV cache."""

from __future__ import annotations

import torch


def write_kv_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [T, KVH, D] into caches [NB, BS, KVH, D] at flat slots; slots < 0 are skipped."""
    num_blocks, block_size = k_cache.shape[:2]
    flat_k = k_cache.view(num_blocks * block_size, *k_cache.shape[2:])
    flat_v = v_cache.view(num_blocks * block_size, *v_cache.shape[2:])
    slots = slot_mapping[: key.shape[0]]
    valid = slots >= 0
    # Boolean indexing syncs with the host; acceptable for the CPU reference, the Triton kernel avoids it.
    idx = slots[valid]
    flat_k[idx] = key[valid].to(k_cache.dtype)
    flat_v[idx] = value[valid].to(v_cache.dtype)
