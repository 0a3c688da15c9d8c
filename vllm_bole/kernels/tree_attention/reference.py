"""Readable torch reference of ancestor-masked attention for tree nodes over a committed prefix.

Each query row (a tree node) sees every key of its request's committed prefix, plus the keys of the tree
region that ``region_mask`` marks (its ancestors and itself). Keys are laid out prefix first, region last.

Paged caches are read through a slot view: ``paged.get(slots) -> (k, v)`` (``[n, Hkv, d]`` each),
``paged.set(slots, k, v)`` and ``paged.block_size``; :class:`FlashPagedKV` is the view of vLLM's FlashAttention
cache (the CPU backend has its own).
"""

import torch


def tree_attention(q, k, v, region_mask, scale):
    """q: ``[R, Hq, d]``; k, v: ``[S, Hkv, d]`` (prefix = first ``S - region_mask.shape[1]`` keys);
    region_mask: ``[R, T]`` bool over the last T keys. Returns ``[R, Hq, d]`` in q's dtype (float32 math)."""
    s, hkv = k.shape[0], k.shape[1]
    r, hq = q.shape[0], q.shape[1]
    t = region_mask.shape[1]
    group = hq // hkv
    visible = torch.cat([torch.ones(r, s - t, dtype=torch.bool, device=q.device), region_mask.bool()], dim=1)
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)            # [Hq, S, d]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (q.float().transpose(0, 1) @ kf.transpose(-1, -2)) * scale       # [Hq, R, S]
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vf                                   # [Hq, R, d]
    return out.transpose(0, 1).to(q.dtype)


def request_slots(block_table_row: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """vLLM slots (``block * block_size + offset``) of a request's positions."""
    return block_table_row[positions // block_size].long() * block_size + positions % block_size


class FlashPagedKV:
    """Slot view of a FlashAttention cache, logical ``[num_blocks, kv_heads, block_size, 2 * head]`` (K first)."""

    def __init__(self, kv_cache: torch.Tensor):
        d = kv_cache.shape[-1] // 2
        self.k, self.v = kv_cache[..., :d], kv_cache[..., d:]
        self.block_size = kv_cache.shape[2]

    def get(self, slots: torch.Tensor):
        b, o = slots // self.block_size, slots % self.block_size
        return self.k[b, :, o], self.v[b, :, o]

    def set(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        b, o = slots // self.block_size, slots % self.block_size
        self.k[b, :, o] = k
        self.v[b, :, o] = v


def paged_tree_attention(paged, q, out, seq_lens, block_table, tree_rows, scale, *, non_causal_only=False):
    """Writes every tree row's attention into ``out`` (``[N, Hq, d]``, rows of q).

    tree_rows: objects with ``req_index`` (row of ``block_table`` / ``seq_lens``), ``row_start`` and
    ``region_mask`` ``[n_rows, T]`` (see ``step.forest.TreeRows``); request positions
    ``seq_len - T .. seq_len - 1`` are the region. ``non_causal_only`` skips the rows a causal kernel already
    got right. seq_lens: host list.
    """
    for rows in tree_rows:
        pick = torch.arange(rows.region_mask.shape[0])
        if non_causal_only:
            pick = rows.differs_from_causal().nonzero().flatten()
            if pick.numel() == 0:
                continue
        positions = torch.arange(seq_lens[rows.req_index], device=q.device)
        k, v = paged.get(request_slots(block_table[rows.req_index], positions, paged.block_size))
        idx = pick.to(q.device) + rows.row_start
        out[idx] = tree_attention(q[idx], k, v, rows.region_mask[pick].to(q.device), scale).to(out.dtype)


def paged_prefix_attention(paged, q, prefix_lens, block_table, query_start_loc, scale):
    """FlashAttention's non-causal pass over each request's first ``prefix_lens[b]`` keys for its query rows
    ``query_start_loc[b] .. query_start_loc[b+1]`` (host lists): ``(out [N, Hq, d], lse [Hq, N])``, natural-log
    LSE. Rows of an empty prefix are left as ``out``'s and ``lse``'s fill (NaN), as no caller may read them."""
    n, hq, d = q.shape
    out = torch.full_like(q, float("nan"))
    lse = torch.full((hq, n), float("nan"), dtype=torch.float32, device=q.device)
    for b, p in enumerate(prefix_lens):
        rows = slice(query_start_loc[b], query_start_loc[b + 1])
        if p == 0 or rows.start == rows.stop:
            continue
        k, v = paged.get(request_slots(block_table[b], torch.arange(p, device=q.device), paged.block_size))
        group = hq // k.shape[1]
        kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
        vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (q[rows].float().transpose(0, 1) @ kf.transpose(-1, -2)) * scale   # [Hq, r, p]
        lse[:, rows] = torch.logsumexp(scores, dim=-1)
        out[rows] = (torch.softmax(scores, dim=-1) @ vf).transpose(0, 1).to(q.dtype)
    return out, lse


def compact_kv(paged, src_slots, dst_slots):
    """Move the accepted path's K/V: every ``src_slots[i]`` to ``dst_slots[i]`` (gather all, then scatter)."""
    if len(src_slots) == 0:
        return
    k, v = paged.get(src_slots)
    paged.set(dst_slots, k.clone(), v.clone())
