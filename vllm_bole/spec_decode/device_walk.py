"""The greedy tree walk on the device: every request's accepted path from the verification rows, no host copy.

Node i is accepted when its parent is accepted and its token is the target's argmax at the parent's row; the root
always is. Where several children of one node carry the target's token, :func:`tree_sampler.walk_tree` follows
the first, and so does this walk (a node counts only if no earlier sibling matches), so the accepted nodes form
one path. Its deepest node ends it and the argmax at that node's row is the bonus token.

Every shape is a host bound (``max_depth``), so the same ops run eagerly and inside a CUDA graph; the loops run
once per tree level (tens of tiny ops; the host walk instead copies every row's argmax to the host first). On the
GPU, given a bound on the trees' sizes, one Triton launch does the same (``kernels/tree_walk/triton_walk.py``).
"""

from dataclasses import dataclass

import torch

from ..kernels import _use_triton


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


def _forest_rows(parent: torch.Tensor, cu_seqlens: torch.Tensor):
    """(rows ``[N]``, tree of each row, first row of each tree, root mask, global parent (a root: itself))."""
    n, device = parent.numel(), parent.device
    rows = torch.arange(n, device=device)
    tree = torch.searchsorted(cu_seqlens[1:].long(), rows, right=True)
    start = cu_seqlens[:-1].long()
    is_root = parent < 0
    return rows, tree, start, is_root, torch.where(is_root, rows, start[tree] + parent.long())


def _depths(is_root: torch.Tensor, grow: torch.Tensor, max_depth: int) -> torch.Tensor:
    depth = torch.zeros(grow.numel(), dtype=torch.long, device=grow.device)
    for _ in range(max_depth):   # parents first: depth d settles in d rounds
        depth = torch.where(is_root, 0, depth[grow] + 1)
    return depth


def synthetic_targets(tokens: torch.Tensor, parent: torch.Tensor, cu_seqlens: torch.Tensor, max_depth: int,
                      synthetic, generator: torch.Generator | None = None, max_nodes: int | None = None) -> torch.Tensor:
    """``[N]`` the target's token after each row under synthetic acceptance (``spec_decode/synthetic.py``), drawn
    on the device: the token of the child whose sibling rank ``synthetic.draw_rank`` returns at the row's depth + 1
    (independent draws with its probabilities), or -1, which no child carries, when it draws none or that rank
    has no child. :func:`greedy_walk` on these targets accepts what ``synthetic.walk`` accepts, in distribution.
    ``max_nodes``: a host bound on any tree's size; with it, CUDA tensors take one Triton launch (the same
    targets from the same draws)."""
    n, device = parent.numel(), parent.device
    ranks = 1 + len(synthetic.sibling_rates)
    first, siblings = _synthetic_rates(synthetic, max_depth, device)
    u = torch.rand(n, ranks, generator=generator, device=device)
    if max_nodes is not None and _use_triton(parent):
        from ..kernels.tree_walk import triton_walk

        if max_nodes <= triton_walk.MAX_TREE_NODES:
            return triton_walk.synthetic_targets(tokens, parent, cu_seqlens, max_depth, u, first, siblings, max_nodes)
    return synthetic_targets_reference(tokens, parent, cu_seqlens, max_depth, u, first, siblings)


_RATES: dict = {}


def _synthetic_rates(synthetic, max_depth: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank 1's conditional rate for the children of a row at depth 0..max_depth, the sibling rates), float32
    on ``device``; made once per (rates, depth bound, device): a fresh copy each step would cost a transfer."""
    key = (synthetic.rates, synthetic.sibling_rates, max_depth, str(device))
    if key not in _RATES:
        if len(_RATES) > 64:
            _RATES.clear()
        first = torch.tensor([synthetic.rank1_rate(d) for d in range(1, max_depth + 2)], dtype=torch.float32)
        siblings = torch.tensor(list(synthetic.sibling_rates) or [0.0], dtype=torch.float32)
        _RATES[key] = (first.to(device, non_blocking=True), siblings.to(device, non_blocking=True))
    return _RATES[key]


def synthetic_targets_reference(tokens: torch.Tensor, parent: torch.Tensor, cu_seqlens: torch.Tensor,
                                max_depth: int, u: torch.Tensor, first_rate: torch.Tensor,
                                sibling_rate: torch.Tensor) -> torch.Tensor:
    """:func:`synthetic_targets` in torch ops from given draws ``u`` ``[N, ranks]`` and rates (the CPU path and
    the Triton kernel's reference)."""
    n, device = parent.numel(), parent.device
    rows, _, _, is_root, grow = _forest_rows(parent, cu_seqlens)
    depth = _depths(is_root, grow, max_depth)
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
                max_depth: int, bonus: torch.Tensor | None = None, max_nodes: int | None = None) -> DeviceWalk:
    """``argmax``: ``[N]`` the target's token after each row; ``tokens``: ``[N]`` each row's token (roots: any);
    ``parent``: ``[N]`` int32 local parent within the row's tree (-1: the root, local node 0); ``cu_seqlens``:
    ``[B+1]`` int32 tree offsets (rows of tree b: ``cu[b]:cu[b+1]``, every tree non-empty); ``max_depth``: no
    node lies deeper (the root at depth 0); ``bonus``: ``[N]`` the token emitted after a path's last node, if
    not ``argmax`` (synthetic targets match children only). ``max_nodes``: a host bound on any tree's size; with
    it, CUDA tensors take the one-launch Triton walk (``kernels/tree_walk/triton_walk.py``), else this one."""
    bonus = argmax if bonus is None else bonus
    if max_nodes is not None and _use_triton(parent):
        from ..kernels.tree_walk.triton_walk import MAX_TREE_NODES, tree_walk

        if max_nodes <= MAX_TREE_NODES:
            rows, length, deepest, emitted = tree_walk(argmax, tokens, parent, cu_seqlens, max_depth, bonus,
                                                       max_nodes)
            return DeviceWalk(rows=rows, length=length, deepest=deepest, emitted=emitted)
    return greedy_walk_reference(argmax, tokens, parent, cu_seqlens, max_depth, bonus)


def greedy_walk_reference(argmax: torch.Tensor, tokens: torch.Tensor, parent: torch.Tensor,
                          cu_seqlens: torch.Tensor, max_depth: int, bonus: torch.Tensor) -> DeviceWalk:
    """:func:`greedy_walk` in torch ops (the CPU path and the Triton walk's reference)."""
    n, device = parent.numel(), parent.device
    b = cu_seqlens.numel() - 1
    rows, tree, start, is_root, grow = _forest_rows(parent, cu_seqlens)
    match = ~is_root & (tokens.long() == argmax.long()[grow])
    # Only the first matching child of a node counts (the host walk follows that one).
    first = torch.full((n,), n, dtype=torch.long, device=device)
    first.scatter_reduce_(0, grow, torch.where(match, rows, n), reduce="amin")
    match &= first[grow] == rows
    depth = _depths(is_root, grow, max_depth)
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
    return DeviceWalk(rows=path, length=length, deepest=last - start, emitted=emitted.to(torch.int32))
