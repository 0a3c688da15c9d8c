"""The greedy tree walk on the device: every request's accepted path from the verification rows, no host copy.

Node i is accepted when its parent is accepted and its token is the target's argmax at the parent's row; the root
always is. Where several children of one node carry the target's token, :func:`tree_sampler.walk_tree` follows
the first, and so does this walk (a node counts only if no earlier sibling matches), so the accepted nodes form
one path. Its deepest node ends it and the argmax at that node's row is the bonus token.

Every shape is a host bound (``max_depth``), so the same ops run eagerly and inside a CUDA graph; the loops run
once per tree level (tens of tiny ops; the host walk instead copies every row's argmax to the host first).
"""

from dataclasses import dataclass

import torch


@dataclass
class DeviceWalk:
    """Accepted paths of ``B`` trees, ``W = max_depth + 1`` columns each, on the device."""

    rows: torch.Tensor       # [B, W] int64 flat row of each path node, root first; -1 past the path
    length: torch.Tensor     # [B] int64 nodes on the path (the root counts: >= 1)
    deepest: torch.Tensor    # [B] int64 local index of the path's last node (what the commit reads)
    emitted: torch.Tensor    # [B, W] int32 tokens the step emits: the path's drafted tokens, the bonus, then -1

    def host_paths(self, query_starts: list[int]) -> list[list[int]]:
        """The paths as local node lists (one copy; waits for the walk)."""
        rows, length = self.rows.tolist(), self.length.tolist()
        return [[r - start for r in row[:n]] for row, n, start in zip(rows, length, query_starts)]


def greedy_walk(argmax: torch.Tensor, tokens: torch.Tensor, parent: torch.Tensor, cu_seqlens: torch.Tensor,
                max_depth: int) -> DeviceWalk:
    """``argmax``: ``[N]`` the target's token after each row; ``tokens``: ``[N]`` each row's token (roots: any);
    ``parent``: ``[N]`` int32 local parent within the row's tree (-1: the root, local node 0); ``cu_seqlens``:
    ``[B+1]`` int32 tree offsets (rows of tree b: ``cu[b]:cu[b+1]``, every tree non-empty); ``max_depth``: no
    node lies deeper (the root at depth 0)."""
    n, device = parent.numel(), parent.device
    b = cu_seqlens.numel() - 1
    rows = torch.arange(n, device=device)
    tree = torch.searchsorted(cu_seqlens[1:].long(), rows, right=True)          # [N] tree of each row
    start = cu_seqlens[:-1].long()
    local_parent = parent.long()
    is_root = local_parent < 0
    grow = torch.where(is_root, rows, start[tree] + local_parent)               # global parent (root: itself)
    match = ~is_root & (tokens.long() == argmax.long()[grow])
    # Only the first matching child of a node counts (the host walk follows that one).
    first = torch.full((n,), n, dtype=torch.long, device=device)
    first.scatter_reduce_(0, grow, torch.where(match, rows, n), reduce="amin")
    match &= first[grow] == rows
    accepted, depth = is_root.clone(), torch.zeros(n, dtype=torch.long, device=device)
    for _ in range(max_depth):   # parents first: depth d settles in d rounds
        accepted = is_root | (match & accepted[grow])
        depth = torch.where(is_root, 0, depth[grow] + 1)
    # One accepted node per depth: the deepest one per tree ends the path.
    key = torch.where(accepted, depth * n + rows, -1)
    best = torch.full((b,), -1, dtype=torch.long, device=device)
    best.scatter_reduce_(0, tree, key, reduce="amax")
    last = best % n
    length = best // n + 1
    width = max_depth + 1
    # Walk up from the deepest node: column t holds its t-th ancestor (the root, then itself, past the top).
    up = torch.empty(b, width, dtype=torch.long, device=device)
    cur = last
    for t in range(width):
        up[:, t] = cur
        cur = grow[cur]
    col = torch.arange(width, device=device)
    on_path = col[None, :] < length[:, None]
    path = torch.where(on_path, up.gather(1, (length[:, None] - 1 - col[None, :]).clamp(min=0)), -1)
    # Emitted: the drafted token of path node j + 1, then the bonus (the argmax at the last node).
    after = torch.cat([path[:, 1:], path.new_full((b, 1), -1)], dim=1)
    emitted = torch.where(after >= 0, tokens.long()[after.clamp(min=0)], -1)
    emitted = torch.where(col[None, :] == length[:, None] - 1, argmax.long()[last][:, None], emitted)
    return DeviceWalk(rows=path, length=length, deepest=last - start, emitted=emitted.to(torch.int32))
