"""Reference (pure torch) paged attention over a mixed batch of prefill chunks and decodes."""

from __future__ import annotations

import torch

# Queries are processed in chunks of this many rows so a long prefill never builds a huge score matrix.
_QUERY_CHUNK = 256


def paged_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of query [T, H, D] over paged K/V [NB, BS, KVH, D]; returns [T, H, D].

    Request b's q_len queries sit at the last q_len of its seq_lens[b] positions. Query head h reads
    KV head h // (H // KVH). With `sliding_window` w, a query at position p sees keys in (p - w, p].
    Padded rows (t >= query_start_loc[-1]) are zero.
    """
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.zeros_like(query)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    out[qsl[-1] :] = 0
    for b, seq_len in enumerate(lens):
        start, end = qsl[b], qsl[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        n_blocks = (seq_len + block_size - 1) // block_size
        blocks = block_tables[b, :n_blocks].to(torch.int64)
        # [KVH, S, D] in fp32: gathered once per request, shared by every query chunk.
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].transpose(0, 1).float()
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].transpose(0, 1).float()
        key_pos = torch.arange(seq_len, device=query.device)
        for c0 in range(0, q_len, _QUERY_CHUNK):
            c1 = min(q_len, c0 + _QUERY_CHUNK)
            n = c1 - c0
            # Group query heads by their KV head so K/V are never repeated: rows are (query, group member).
            q = query[start + c0 : start + c1].view(n, num_kv_heads, group, head_dim)
            q = q.transpose(0, 1).reshape(num_kv_heads, n * group, head_dim).float()
            scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [KVH, n * G, S]
            q_pos = (seq_len - q_len + c0 + torch.arange(n, device=query.device)).repeat_interleave(group)
            masked = key_pos[None, :] > q_pos[:, None]
            if sliding_window is not None:
                masked |= key_pos[None, :] <= q_pos[:, None] - sliding_window
            scores.masked_fill_(masked, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            o = torch.matmul(probs, v)  # [KVH, n * G, D]
            o = o.view(num_kv_heads, n, group, head_dim).transpose(0, 1).reshape(n, num_heads, head_dim)
            out[start + c0 : start + c1] = o.to(out.dtype)
    return out
