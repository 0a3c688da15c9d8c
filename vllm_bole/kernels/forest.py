"""Helpers over a packed forest of proposal trees (torch, device-agnostic).

A forest packs B requests' trees into N nodes. ``cu_seqlens[b]:cu_seqlens[b+1]`` are request b's nodes and
``parent[i]`` is the index of i's parent *within its request's segment* (-1 for a root, i.e. a child of the
committed prefix). Parents come before children, so every ancestor has a smaller index than its descendants.
"""

import torch


def ancestor_mask(parent: torch.Tensor) -> torch.Tensor:
    """``[T, T]`` bool, ``mask[i, j]`` true iff j is i or one of i's ancestors (one tree segment)."""
    t = parent.numel()
    mask = torch.eye(t, dtype=torch.bool, device=parent.device)
    par = parent.tolist()
    for i in range(t):
        if par[i] >= 0:
            mask[i] |= mask[par[i]]
    return mask


def path_to_root(parent: torch.Tensor, node: int) -> list[int]:
    """Local indices root -> ... -> node (empty for node == -1)."""
    par = parent.tolist()
    path = []
    while node >= 0:
        path.append(node)
        node = par[node]
    return path[::-1]


def node_depths(parent: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[N]`` int32 depth of every node (a root has depth 0)."""
    depth = torch.zeros_like(parent, dtype=torch.int32)
    par = parent.tolist()
    cu = cu_seqlens.tolist()
    for b in range(len(cu) - 1):
        for i in range(cu[b], cu[b + 1]):
            depth[i] = 0 if par[i] < 0 else depth[cu[b] + par[i]] + 1
    return depth


def validate_forest(parent: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    """Raise ValueError unless every parent precedes its child inside its own segment."""
    cu = cu_seqlens.tolist()
    par = parent.tolist()
    if cu[0] != 0 or cu[-1] != len(par) or any(a > b for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to N={len(par)}, got {cu}")
    for b in range(len(cu) - 1):
        for local, i in enumerate(range(cu[b], cu[b + 1])):
            if not -1 <= par[i] < local:
                raise ValueError(
                    f"parent[{i}]={par[i]} (request {b}, local node {local}) must be -1 or a local index < {local}")


def pack_bits(mask: torch.Tensor, words: int) -> torch.Tensor:
    """``[rows, cols]`` bool -> ``[rows, words]`` int32, column j at bit j % 32 of word j // 32 (the layout of
    ``DeviceTreeRows.bits``), on the mask's device."""
    rows, cols = mask.shape
    wide = torch.zeros(rows, words * 32, dtype=torch.int64, device=mask.device)
    wide[:, :cols] = mask
    weights = torch.ones(32, dtype=torch.int64, device=mask.device) << torch.arange(32, device=mask.device)
    packed = (wide.view(rows, words, 32) * weights).sum(dim=-1)        # < 2^32: the int32 bit pattern
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
