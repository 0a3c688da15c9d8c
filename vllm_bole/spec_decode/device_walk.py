"""The greedy tree walk on the device: every request's accepted path from the verification rows, no host copy.

Node i is accepted when its parent is accepted and its token is the target's argmax at the parent's row; the root
always is. Where several children of one node carry the target's token, :func:`tree_sampler.walk_tree` follows
the first, and so does this walk (a node counts only if no earlier sibling matches), so the accepted nodes form
one path. Its deepest node ends it and the argmax at that node's row is the bonus token.

Every shape is a host bound (``max_depth``), so the same ops run eagerly and inside a CUDA graph: the torch walk
(``kernels/tree_walk/reference.py``) runs one round per tree level (tens of tiny ops; the host walk instead copies
every row's argmax to the host first). On the GPU, given a bound on the trees' sizes, one Triton launch does the
same (``kernels/tree_walk/triton_walk.py``).
"""

from dataclasses import dataclass

import torch

from ..kernels import _use_triton
from ..kernels.tree_walk import reference


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
    targets = None
    if max_nodes is not None and _use_triton(parent):
        from ..kernels.tree_walk import triton_walk

        if max_nodes <= triton_walk.MAX_TREE_NODES:
            targets = triton_walk.synthetic_targets(tokens, parent, cu_seqlens, max_depth, u, first, siblings,
                                                    max_nodes)
    if targets is None:
        targets = reference.synthetic_targets(tokens, parent, cu_seqlens, max_depth, u, first, siblings)
    if synthetic.draft_vocab_coverage < 1.0:   # the target's token outside the draft vocabulary: no child matches
        inside = torch.rand(n, generator=generator, device=device) < synthetic.draft_vocab_coverage
        targets = torch.where(inside, targets, -1)
    return targets


_RATES: dict = {}


def _synthetic_rates(synthetic, max_depth: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank 1's conditional rate for the children of a row at depth 0..max_depth inside the draft vocabulary, the
    sibling rates), float32 on ``device``; made once per (rates, depth bound, device): a fresh copy each step would
    cost a transfer."""
    key = (synthetic.rates, synthetic.sibling_rates, max_depth, str(device))
    if key not in _RATES:
        if len(_RATES) > 64:
            _RATES.clear()
        first = torch.tensor([synthetic.in_vocab_rank1_rate(d) for d in range(1, max_depth + 2)],
                             dtype=torch.float32)
        siblings = torch.tensor(list(synthetic.sibling_rates) or [0.0], dtype=torch.float32)
        _RATES[key] = (first.to(device, non_blocking=True), siblings.to(device, non_blocking=True))
    return _RATES[key]


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
    return DeviceWalk(*reference.greedy_walk(argmax, tokens, parent, cu_seqlens, max_depth, bonus))
