"""Readable torch reference of the causal depthwise conv1d over a packed forest, and its state commit.

A chain conv at token t reads x[t-W+1 .. t]; a tree node reads its own input, then its ancestors' inputs
(nearest first), then the request's committed conv state (most recent last), W taps in all.
conv_state: ``[B, dim, W-1]`` (vLLM's "(..., dim, width-1)" view; strided views are fine), entry ``W-2`` is
the most recent committed input.
"""

import torch
import torch.nn.functional as F

from ..forest import path_to_root


def _window(x, conv_state_b, parent_seg, start, node, width):
    """``[dim, W]`` float32 inputs seen by ``node`` (local index), oldest first.

    Float32, not x's dtype: a conv state kept wider than x (e.g. float32 state, bf16 inputs) must be
    neither rounded in the conv nor in the committed window."""
    path = [start + j for j in path_to_root(parent_seg, node)]
    hist = torch.cat([conv_state_b.float(), x[path].float().transpose(0, 1)], dim=1)
    return hist[:, -width:]


def tree_causal_conv1d(x, weight, bias, conv_state, parent, cu_seqlens, activation="silu"):
    """x: ``[N, dim]``; weight: ``[dim, W]``; bias: ``[dim]`` or None; conv_state: ``[B, dim, W-1]``.

    Returns ``[N, dim]`` in the dtype of x; conv_state is not modified (see :func:`commit_conv_state`).
    """
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    width = weight.shape[1]
    out = torch.empty_like(x)
    cu = cu_seqlens.tolist()
    for b in range(len(cu) - 1):
        s, e = cu[b], cu[b + 1]
        for i in range(s, e):
            win = _window(x, conv_state[b], parent[s:e], s, i - s, width).float()
            y = (win * weight.float()).sum(-1)
            if bias is not None:
                y = y + bias.float()
            # Round the pre-activation to x's dtype first, as vLLM's CPU conv (bf16 F.conv1d, then SiLU) does.
            y = y.to(x.dtype)
            out[i] = F.silu(y) if activation else y
    return out


def commit_conv_state(conv_state, x, parent, cu_seqlens, accepted):
    """New ``[B, dim, W-1]`` conv state: the last W-1 inputs along root..accepted[b] (-1 keeps it unchanged)."""
    new_state = conv_state.clone()
    width = conv_state.shape[-1] + 1
    cu = cu_seqlens.tolist()
    for b, a in enumerate(accepted.tolist()):
        if a < 0:
            continue
        s, e = cu[b], cu[b + 1]
        win = _window(x, conv_state[b], parent[s:e], s, a, width)
        new_state[b] = win[:, 1:].to(conv_state.dtype)
    return new_state


def commit_conv_state_inplace(conv_states, state_indices, xs, parent, cu_seqlens, accepted):
    """Commit every layer's conv window at once: conv_states is a list of L ``[num_slots, dim, W-1]`` views,
    xs the stacked conv inputs ``[L, N, dim]``; writes ``conv_states[l][state_indices[b]]``."""
    idx = state_indices.long()
    for layer, cache in enumerate(conv_states):
        cache[idx] = commit_conv_state(cache[idx], xs[layer], parent, cu_seqlens, accepted)
