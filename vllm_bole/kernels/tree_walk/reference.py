"""The torch twins of the Triton tree walk (``triton_walk.py``): the greedy walk of a packed forest and the synthetic
targets it walks in benchmarks. The CPU path and the kernels' reference. Every loop runs once per tree level
(``max_depth`` rounds, parents before children), so the same ops also run inside a CUDA graph."""

import torch


def forest_rows(parent: torch.Tensor, cu_seqlens: torch.Tensor):
    """(rows ``[N]``, tree of each row, first row of each tree, root mask, global parent (a root: itself))."""
    n, device = parent.numel(), parent.device
    rows = torch.arange(n, device=device)
    tree = torch.searchsorted(cu_seqlens[1:].long(), rows, right=True)
    start = cu_seqlens[:-1].long()
    is_root = parent < 0
    return rows, tree, start, is_root, torch.where(is_root, rows, start[tree] + parent.long())


def depths(is_root: torch.Tensor, grow: torch.Tensor, max_depth: int) -> torch.Tensor:
    """``[N]`` each row's depth in its tree (``grow``: each row's global parent, a root itself)."""
    depth = torch.zeros(grow.numel(), dtype=torch.long, device=grow.device)
    for _ in range(max_depth):   # parents first: depth d settles in d rounds
        depth = torch.where(is_root, 0, depth[grow] + 1)
    return depth


def synthetic_targets(tokens: torch.Tensor, parent: torch.Tensor, cu_seqlens: torch.Tensor, max_depth: int,
                      u: torch.Tensor, first_rate: torch.Tensor, sibling_rate: torch.Tensor) -> torch.Tensor:
    """``[N]`` the target's token after each row under synthetic acceptance, from given draws ``u`` ``[N, ranks]``
    and rates (``spec_decode/device_walk.synthetic_targets``, which draws them): the token of the child whose
    sibling rank the draws pick at the row's depth + 1, or -1."""
    n, device = parent.numel(), parent.device
    rows, _, _, is_root, grow = forest_rows(parent, cu_seqlens)
    depth = depths(is_root, grow, max_depth)
    ranks = u.shape[1]
    # Sibling rank of every child: its order among its parent's children (parents before children, so by row).
    key = torch.where(is_root, n + rows, grow)
    order = torch.sort(key, stable=True).indices
    sorted_key = key[order]
    rank = torch.empty(n, dtype=torch.long, device=device)
    rank[order] = torch.arange(n, device=device) - torch.searchsorted(sorted_key, sorted_key)
    # One spare slot takes the rows that are no child of rank < ranks (a masked index would wait for the device).
    child_at = torch.full((n * ranks + 1,), -1, dtype=torch.long, device=device)
    child = ~is_root & (rank < ranks)
    child_at[torch.where(child, grow * ranks + rank, n * ranks)] = torch.where(child, rows, -1)
    # The rank drawn at each row: rank 1 with the conditional rate at its children's depth, else the first
    # sibling rank whose rate the draws pass.
    drawn = torch.where(u[:, 0] < first_rate[depth], 0, -1)
    for r in range(ranks - 1, 0, -1):   # the lowest passing rank wins
        drawn = torch.where((drawn != 0) & (u[:, r] < sibling_rate[r - 1]), r, drawn)
    pick = torch.where(drawn >= 0, child_at[rows * ranks + drawn.clamp(min=0)], -1)
    return torch.where(pick >= 0, tokens.long()[pick.clamp(min=0)], -1)


def greedy_walk(argmax: torch.Tensor, tokens: torch.Tensor, parent: torch.Tensor, cu_seqlens: torch.Tensor,
                max_depth: int, bonus: torch.Tensor):
    """The accepted path of every tree of a packed forest (the contract of ``spec_decode/device_walk.greedy_walk``):
    ``(rows [B, W], length [B], deepest [B], emitted [B, W])``, ``W = max_depth + 1``."""
    n, device = parent.numel(), parent.device
    b = cu_seqlens.numel() - 1
    rows, tree, start, is_root, grow = forest_rows(parent, cu_seqlens)
    match = ~is_root & (tokens.long() == argmax.long()[grow])
    # Only the first matching child of a node counts (the host walk follows that one).
    first = torch.full((n,), n, dtype=torch.long, device=device)
    first.scatter_reduce_(0, grow, torch.where(match, rows, n), reduce="amin")
    match &= first[grow] == rows
    depth = depths(is_root, grow, max_depth)
    accepted = is_root.clone()
    for _ in range(max_depth):   # parents first: depth d settles in d rounds
        accepted = is_root | (match & accepted[grow])
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
    emitted = torch.where(col[None, :] == length[:, None] - 1, bonus.long()[last][:, None], emitted)
    return path, length, last - start, emitted.to(torch.int32)
