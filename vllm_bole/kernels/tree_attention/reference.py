"""Readable torch reference of ancestor-masked attention for tree nodes over a committed prefix.

Each query row (a tree node) sees every key of its request's committed prefix, plus the keys of the tree
region that ``region_mask`` marks (its ancestors and itself). Keys are laid out prefix first, region last.
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


def compact_kv(paged, src_slots, dst_slots):
    """Move the accepted path's K/V: every ``src_slots[i]`` to ``dst_slots[i]`` (gather all, then scatter).

    ``paged.get(slots) -> (k, v)`` and ``paged.set(slots, k, v)`` hide the backend's cache layout.
    """
    if len(src_slots) == 0:
        return
    k, v = paged.get(src_slots)
    paged.set(dst_slots, k.clone(), v.clone())
