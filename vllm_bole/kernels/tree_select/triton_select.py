"""Per-request quota selection of the device beam's candidates in one Triton launch: one program per request.

Same contract as the torch twin ``reference.quota_select``: each request keeps its ``counts[g]`` best candidates by
(score descending, shallower, lower index) and lists them in candidate order with parents re-indexed among them.
The torch version runs some twenty small ops (stable sorts, scatters, gathers) whose launches cost the host more
than the GPU spends on them; here a candidate's rank is the number of candidates that beat it ([BLOCK, BLOCK]
comparisons) and its place among the kept ones a prefix sum.
"""

import torch
import triton
import triton.language as tl

MAX_CANDIDATES = 256   # larger beams take the torch selection ([BLOCK, BLOCK] tiles beyond that)


@triton.jit(do_not_specialize=["n", "W"])
def _quota_select_kernel(scores, depths, tokens, parents, counts, chosen_out, tokens_out, parents_out,
                         depths_out, n, W, s_stride, t_stride, p_stride, BLOCK: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    valid = i < n
    s = tl.load(scores + g * s_stride + i, mask=valid, other=0.0)
    d = tl.load(depths + i, mask=valid, other=0)
    # j beats i: higher score, or the same score and shallower, or both the same and a lower index.
    sj, si = s[None, :], s[:, None]
    dj, di = d[None, :], d[:, None]
    beats = (sj > si) | ((sj == si) & ((dj < di) | ((dj == di) & (i[None, :] < i[:, None]))))
    rank = tl.sum((beats & valid[None, :]).to(tl.int32), axis=1)
    count = tl.load(counts + g)
    keep = valid & (rank < count)
    place = tl.cumsum(keep.to(tl.int32), axis=0) - 1          # among the kept ones, candidate order
    tl.store(chosen_out + g * n + i, keep.to(tl.float64), mask=valid)
    par = tl.load(parents + g * p_stride + i, mask=valid, other=-1.0).to(tl.int32)
    # The parent's place (a kept node's parent is kept: the selection is connected); -1 for the root's children.
    par_place = tl.sum(tl.where(i[None, :] == par[:, None], place[None, :], 0), axis=1)
    par_place = tl.where(par >= 0, par_place, -1)
    tok = tl.load(tokens + g * t_stride + i, mask=valid, other=0.0).to(tl.int64)
    out = g * W + place
    ok = keep & (place < W)
    tl.store(tokens_out + out, tok, mask=ok)
    tl.store(parents_out + out, par_place.to(tl.int64), mask=ok)
    tl.store(depths_out + out, d.to(tl.int64), mask=ok)


def quota_select(scores: torch.Tensor, depths: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                 counts: torch.Tensor, width: int):
    """``scores``, ``tokens``, ``parents``: ``[G, n]`` float64 candidates (rows may be strided views), ``depths``:
    ``[n]`` int64, ``counts``: ``[G]`` int64 quotas on the device, ``width``: at least the largest quota.
    Returns (chosen ``[G, n]`` float64 0/1, tokens, parents, depths ``[G, width]`` int64; entries past a
    request's kept count are unspecified)."""
    g, n = scores.shape
    assert scores.stride(1) == tokens.stride(1) == parents.stride(1) == 1 and depths.is_contiguous()
    assert n <= MAX_CANDIDATES
    dev = scores.device
    chosen = torch.empty(g, n, dtype=torch.float64, device=dev)
    out = torch.empty(3, g, width, dtype=torch.int64, device=dev)
    if g:
        _quota_select_kernel[(g,)](scores, depths, tokens, parents, counts, chosen, out[0], out[1], out[2], n,
                                   width, scores.stride(0), tokens.stride(0), parents.stride(0),
                                   BLOCK=max(16, triton.next_power_of_2(n)), num_warps=4 if n <= 128 else 8)
    return chosen, out[0], out[1], out[2]
