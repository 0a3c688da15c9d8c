"""The greedy tree walk of a packed forest in one Triton launch: one program per tree, the whole tree in registers
(and, for benchmarks, the synthetic targets it walks, in one more).

Same contract as the torch walk (``reference.greedy_walk``): node i is accepted when its parent is and its token is
the target's token after the parent's row, and no earlier sibling of it matches; the accepted nodes form one path
from the root, one node per depth, so the path's column j is its node at depth j. The torch walk runs tens of tiny
ops per tree level; here the rounds that settle acceptance and depth (one per level, parents before children) are
register gathers within one program.
"""

import torch
import triton
import triton.language as tl

MAX_TREE_NODES = 256   # larger trees take the torch walk ([BLOCK, BLOCK] sibling tiles beyond that)


@triton.jit
def _load_tree(tokens, parent, cu_seqlens, BLOCK: tl.constexpr):
    """This program's tree: (first row, local index, valid lanes, local parent, token, parent or itself)."""
    b = tl.program_id(0)
    start = tl.load(cu_seqlens + b).to(tl.int64)
    size = tl.load(cu_seqlens + b + 1).to(tl.int64) - start
    idx = tl.arange(0, BLOCK)
    valid = idx < size
    par = tl.load(parent + start + idx, mask=valid, other=-1).to(tl.int32)
    tok = tl.load(tokens + start + idx, mask=valid, other=-1).to(tl.int64)
    up = tl.where(par < 0, idx, par)                       # local parent (a root or padding: itself)
    return start, idx, valid, par, tok, up


@triton.jit
def _earlier_siblings(par, idx, flag):
    """Per node, how many earlier siblings (same parent, lower row) have ``flag``."""
    earlier = (par[None, :] == par[:, None]) & (idx[None, :] < idx[:, None]) & flag[None, :]
    return tl.sum(earlier.to(tl.int32), axis=1)


@triton.jit(do_not_specialize=["rounds", "W"])
def _tree_walk_kernel(targets, tokens, parent, cu_seqlens, bonus, rows_out, length_out, deepest_out, emitted_out,
                      rounds, W, BLOCK: tl.constexpr, WP: tl.constexpr):
    b = tl.program_id(0)
    start, idx, valid, par, tok, up = _load_tree(tokens, parent, cu_seqlens, BLOCK)
    is_root = valid & (par < 0)
    after_parent = tl.load(targets + start + up, mask=valid, other=-1).to(tl.int64)
    match = valid & (par >= 0) & (tok == after_parent)
    # Only the first matching child of a node counts (the host walk follows that one).
    match = match & (_earlier_siblings(par, idx, match) == 0)
    accepted = is_root.to(tl.int32)
    depth = tl.zeros([BLOCK], dtype=tl.int32)
    for _ in range(rounds):   # depth d settles in d rounds
        accepted = tl.where(is_root | (match & (tl.gather(accepted, up, 0) != 0)), 1, 0)
        depth = tl.where(par < 0, 0, tl.gather(depth, up, 0) + 1)
    on_path = (accepted != 0) & valid
    length = tl.sum(on_path.to(tl.int32), axis=0)
    last = tl.sum(tl.where(on_path & (depth == length - 1), idx, 0), axis=0)
    # Column j: the path's node at depth j (-1 past the path); emitted j: the token of node j + 1, then the bonus.
    cols = tl.arange(0, WP)
    at = on_path[None, :] & (depth[None, :] == cols[:, None])                     # [WP, BLOCK]
    node = tl.sum(tl.where(at, idx[None, :] + 1, 0), axis=1) - 1
    nxt = on_path[None, :] & (depth[None, :] == cols[:, None] + 1)
    nxt_tok = tl.sum(tl.where(nxt, tok[None, :], 0), axis=1)
    bonus_tok = tl.load(bonus + start + last, mask=length > 0, other=-1).to(tl.int64)
    emitted = tl.where(cols < length - 1, nxt_tok, tl.where(cols == length - 1, bonus_tok, -1))
    out = cols < W
    tl.store(rows_out + b * W + cols, tl.where(node >= 0, start + node, -1), mask=out)
    tl.store(emitted_out + b * W + cols, emitted.to(tl.int32), mask=out)
    tl.store(length_out + b, length.to(tl.int64))
    tl.store(deepest_out + b, last.to(tl.int64))


def tree_walk(targets: torch.Tensor, tokens: torch.Tensor, parent: torch.Tensor, cu_seqlens: torch.Tensor,
              max_depth: int, bonus: torch.Tensor, max_nodes: int):
    """(rows ``[B, W]`` int64, length ``[B]`` int64, deepest ``[B]`` int64, emitted ``[B, W]`` int32) with
    ``W = max_depth + 1``: the fields of ``device_walk.DeviceWalk``. ``max_nodes``: a host bound on any tree's
    node count (at most :data:`MAX_TREE_NODES`); an empty tree gets length 0 and no path."""
    if max_nodes > MAX_TREE_NODES:
        raise ValueError(f"tree_walk: trees of up to {MAX_TREE_NODES} nodes, got a bound of {max_nodes}")
    b, w = cu_seqlens.numel() - 1, max_depth + 1
    device = parent.device
    rows = torch.empty(b, w, dtype=torch.long, device=device)
    emitted = torch.empty(b, w, dtype=torch.int32, device=device)
    length = torch.empty(b, dtype=torch.long, device=device)
    deepest = torch.empty(b, dtype=torch.long, device=device)
    if b:
        _tree_walk_kernel[(b,)](targets, tokens, parent, cu_seqlens, bonus, rows, length, deepest, emitted,
                                max_depth, w, BLOCK=max(16, triton.next_power_of_2(max_nodes)),
                                WP=max(16, triton.next_power_of_2(w)), num_warps=4)
    return rows, length, deepest, emitted


@triton.jit(do_not_specialize=["rounds"])
def _synthetic_targets_kernel(tokens, parent, cu_seqlens, u, first_rate, sibling_rate, targets_out, rounds,
                              RANKS: tl.constexpr, BLOCK: tl.constexpr):
    start, idx, valid, par, tok, up = _load_tree(tokens, parent, cu_seqlens, BLOCK)
    depth = tl.zeros([BLOCK], dtype=tl.int32)
    for _ in range(rounds):
        depth = tl.where(par < 0, 0, tl.gather(depth, up, 0) + 1)
    # Sibling rank: the child's order among its parent's children (by row).
    child = valid & (par >= 0)
    rank = _earlier_siblings(par, idx, child)
    # The rank drawn at each row (as a parent): rank 1 at the conditional rate of its children's depth, else the
    # lowest sibling rank whose rate its draw passes.
    rows = start + idx
    first = tl.load(first_rate + depth, mask=valid, other=0.0)
    drawn = tl.where(tl.load(u + rows * RANKS, mask=valid, other=1.0) < first, 0, -1)
    for r in tl.static_range(RANKS - 1, 0, -1):
        rate = tl.load(sibling_rate + r - 1)
        passed = tl.load(u + rows * RANKS + r, mask=valid, other=1.0) < rate
        drawn = tl.where((drawn != 0) & passed, r, drawn)
    # The token of the child of row i with that rank (-1: none drawn, or no such child).
    hit = (child[None, :] & (par[None, :] == idx[:, None]) & (rank[None, :] == drawn[:, None])
           & (drawn[:, None] >= 0))                                                            # [BLOCK, BLOCK]
    found = tl.sum(hit.to(tl.int32), axis=1) > 0
    token = tl.sum(tl.where(hit, tok[None, :], 0), axis=1)
    tl.store(targets_out + rows, tl.where(found, token, -1), mask=valid)


def synthetic_targets(tokens: torch.Tensor, parent: torch.Tensor, cu_seqlens: torch.Tensor, max_depth: int,
                      u: torch.Tensor, first_rate: torch.Tensor, sibling_rate: torch.Tensor, max_nodes: int):
    """``[N]`` int64 synthetic targets (``spec_decode/device_walk.synthetic_targets``, the reference) from the
    draws ``u`` ``[N, ranks]`` float32, ``first_rate`` ``[max_depth + 1]`` float32 (rank 1's conditional rate of
    the children of a row at each depth) and ``sibling_rate`` ``[ranks - 1]`` float32."""
    if max_nodes > MAX_TREE_NODES:
        raise ValueError(f"synthetic_targets: trees of up to {MAX_TREE_NODES} nodes, got a bound of {max_nodes}")
    b, n = cu_seqlens.numel() - 1, parent.numel()
    out = torch.full((n,), -1, dtype=torch.long, device=parent.device)
    if b:
        _synthetic_targets_kernel[(b,)](tokens, parent, cu_seqlens, u.contiguous(), first_rate, sibling_rate, out,
                                        max_depth, RANKS=u.shape[1], BLOCK=max(16, triton.next_power_of_2(max_nodes)),
                                        num_warps=4)
    return out
