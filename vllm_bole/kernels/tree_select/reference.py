"""The torch twin of the device beam's per-request quota selection (``triton_select.py``): the CPU path and the
kernel's reference."""

import torch


def best_first(scores: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """``[G, n]``: each request's candidate indices by (score descending, shallower, lower index); stable sorts,
    least significant key first."""
    by_depth = torch.sort(depths, stable=True).indices
    return by_depth[torch.sort(scores[:, by_depth], dim=1, descending=True, stable=True).indices]


def quota_mask(scores: torch.Tensor, depths: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``[G, n]`` bool: each request's ``counts[g]`` best nodes by (score, shallower, lower index), the order of
    ``spec_decode/device_beam.selected_mask`` (and of ``tree.select_global`` per tree): a connected tree per
    request."""
    g, n = scores.shape
    order = best_first(scores, depths)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(n, device=scores.device).expand(g, n))
    return rank < counts[:, None]


def quota_select(scores: torch.Tensor, depths: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                 counts: torch.Tensor, width: int):
    """(chosen ``[G, n]`` float64 0/1, tokens, parents, depths ``[G, width]``): each request's ``counts[g]`` best
    of ``[G, n]`` candidates (:func:`quota_mask`; ``depths`` ``[n]``, the same in every row), listed in candidate
    order (parents first) with parents re-indexed among them (-1: the root's children); ``width`` at least the
    largest count."""
    chosen = quota_mask(scores, depths, counts)
    g, n = chosen.shape
    slot = torch.arange(n, device=chosen.device).expand(g, n)
    picked = torch.where(chosen, slot, n).sort(dim=1).values[:, :width]        # [G, W]; n pads short rows
    index = picked.clamp(max=n - 1)
    local = torch.full((g, n + 1), -1, dtype=torch.long, device=chosen.device)
    local.scatter_(1, picked, torch.arange(width, device=chosen.device).expand(g, width))
    parent = parents.gather(1, index).long()
    parent = torch.where(parent >= 0, local.gather(1, parent.clamp(min=0)), -1)
    return chosen.double(), tokens.gather(1, index).long(), parent, depths[index]
