"""Readable torch reference of the causal depthwise conv1d over a packed forest, and its state commit.

A chain conv at token t reads x[t-W+1 .. t]; a tree node reads its own input, then its ancestors' inputs
(nearest first), then the request's committed conv state (most recent last), W taps in all.
conv_state: ``[B, dim, W-1]`` (vLLM's "(..., dim, width-1)" view; strided views are fine), entry ``W-2`` is
the most recent committed input.
"""

import torch
import torch.nn.functional as F


def _global_parents(parent: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(global parent index or -1, request index) of every node."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    req = torch.repeat_interleave(torch.arange(len(lens), device=parent.device), lens)
    start = cu_seqlens[:-1].long()[req]
    gparent = torch.where(parent >= 0, parent.long() + start, torch.full_like(start, -1))
    return gparent, req


def tree_windows(x, conv_state, parent, cu_seqlens, width, nodes=None) -> torch.Tensor:
    """``[n, dim, W]`` inputs each node convolves over, oldest first (``nodes``: global indices, default all).

    Tap ``W-1`` is the node itself, tap ``W-1-d`` its ancestor at distance d; past the root the taps come from
    the committed conv state. Values keep the conv state's dtype where they come from it (no rounding)."""
    gparent, req = _global_parents(parent, cu_seqlens)
    nodes = torch.arange(x.shape[0], device=x.device) if nodes is None else nodes.long()
    dtype = torch.promote_types(x.dtype, conv_state.dtype)
    win = torch.empty(len(nodes), x.shape[1], width, dtype=dtype, device=x.device)
    cur = nodes.clone()                    # ancestor at distance d (-1 once past the root)
    past_root = torch.zeros_like(nodes)    # how many taps ago the walk left the tree
    for d in range(width):
        inside = cur >= 0
        past_root = past_root + (~inside).long()
        tap = width - 1 - d
        win[inside, :, tap] = x[cur[inside]].to(dtype)
        outside = (~inside).nonzero().flatten()
        if len(outside):
            state_idx = (width - 1) - past_root[outside]
            win[outside, :, tap] = conv_state[req[nodes[outside]]].to(dtype).gather(
                -1, state_idx.view(-1, 1, 1).expand(-1, x.shape[1], 1)).squeeze(-1)
        cur = torch.where(inside, gparent[cur.clamp(min=0)], cur)
    return win


def tree_causal_conv1d(x, weight, bias, conv_state, parent, cu_seqlens, activation="silu", *,
                       state_indices=None, x_copy=None):
    """x: ``[N, dim]``; weight: ``[dim, W]``; bias: ``[dim]`` or None; conv_state: ``[B, dim, W-1]``.

    Returns ``[N, dim]`` in the dtype of x; conv_state is not modified (see :func:`commit_conv_state`).
    Each node's output is a depthwise ``F.conv1d`` over its window, the computation vLLM's CPU conv does per
    token, so a chain gives bit-identical results. ``state_indices``: ``[B]``, when given conv_state is a whole
    cache and request b reads its row ``state_indices[b]``; ``x_copy``: ``[N, dim]``, receives a copy of x (the
    commit's conv inputs).
    """
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    if state_indices is not None:
        conv_state = conv_state[state_indices.long()]
    if x_copy is not None:
        x_copy.copy_(x)
    if x.shape[0] == 0:
        return torch.empty_like(x)
    win = tree_windows(x, conv_state, parent, cu_seqlens, weight.shape[1]).to(weight.dtype)
    n, dim, width = win.shape
    # The windows end to end in one sequence, convolved with stride W: each output reads one node's window. One
    # long depthwise conv instead of a batch of n length-W ones, which CPU convolutions run several times slower.
    y = F.conv1d(win.transpose(0, 1).reshape(1, dim, n * width), weight.unsqueeze(1), bias, stride=width,
                 groups=dim)[0].T
    return (F.silu(y) if activation else y).to(x.dtype)


def commit_conv_state(conv_state, x, parent, cu_seqlens, accepted):
    """New ``[B, dim, W-1]`` conv state: the last W-1 inputs along root..accepted[b] (-1 keeps it unchanged)."""
    new_state = conv_state.clone()
    rows = (accepted >= 0).nonzero().flatten()
    if len(rows):
        nodes = cu_seqlens[:-1].long()[rows] + accepted.long()[rows]
        win = tree_windows(x, conv_state, parent, cu_seqlens, conv_state.shape[-1] + 1, nodes)
        new_state[rows] = win[..., 1:].to(conv_state.dtype)
    return new_state


def commit_conv_state_inplace(conv_states, state_indices, xs, parent, cu_seqlens, accepted):
    """Commit every layer's conv window at once: conv_states is a list of L ``[num_slots, dim, W-1]`` views,
    xs the stacked conv inputs ``[L, N, dim]``, state_indices ``[B]`` (all layers) or ``[L, B]`` (per layer)."""
    for layer, cache in enumerate(conv_states):
        idx = (state_indices[layer] if state_indices.dim() == 2 else state_indices).long()
        cache[idx] = commit_conv_state(cache[idx], xs[layer], parent, cu_seqlens, accepted)
