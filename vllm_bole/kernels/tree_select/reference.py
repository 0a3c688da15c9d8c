"""The torch twins of the device beam's kernels: a level's beam advance (``triton_beam.py``) and the per-request
quota selection (``triton_select.py``). The CPU path and the kernels' reference."""

import torch

from ..forest import pack_bits


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


def beam_advance(state, d: int, out: torch.Tensor, top: torch.Tensor, rates: torch.Tensor | None) -> None:
    """Level ``d``'s update of ``state`` (a ``spec_decode/device_beam.BeamState`` of G requests, ``k`` frontier
    nodes each), in place, the contract of ``triton_beam.beam_advance``: each frontier query's ``k`` children
    (``top`` ``[G*k, 2k]``: probabilities, token ids; scored by ``rates`` ``[k]``, the synthetic child scores at
    depth d + 1, where given) become candidates, the ``k`` best of them (ties to the earlier) the next frontier,
    and the next level's inputs follow: ancestor regions and bits, and the hidden states of ``out`` ``[G*k, H]``
    that predicted them."""
    g, k = state.front.shape
    top = top.double()
    n = k + (d - 1) * k * k
    p = top[:, :k] if rates is None else rates.expand(g * k, k)
    p = p.reshape(g, k, k)
    child_tok = top[:, k:].reshape(g, k * k)
    child_score = (state.front_score[:, :, None] * p).reshape(g, k * k)
    state.tokens[:, n:n + k * k] = child_tok
    state.scores[:, n:n + k * k] = child_score
    state.parents[:, n:n + k * k] = state.front.double()[:, :, None].expand(g, k, k).reshape(g, k * k)
    order = torch.sort(child_score, dim=1, descending=True, stable=True).indices[:, :k]
    state.front.copy_(n + order)
    state.front_tok.copy_(child_tok.gather(1, order))
    state.front_score.copy_(child_score.gather(1, order))
    state.front_slot.copy_(order // k)
    # The next level: each new frontier node's query sees its parent query's region and itself (key d*k + j),
    # and reads the hidden state of the query that predicted it.
    state.front_ids.copy_(state.front_tok)
    state.anc.copy_(state.anc.gather(1, state.front_slot[:, :, None].expand(-1, -1, state.anc.shape[2])))
    if (d + 1) * k <= state.anc.shape[2]:   # (no level after the deepest one)
        state.anc[:, :, d * k:(d + 1) * k] |= torch.eye(k, dtype=torch.bool, device=state.anc.device)
    state.bits.copy_(pack_bits(state.anc.reshape(g * k, -1), state.bits.shape[1]))
    rows = torch.arange(g, device=order.device)[:, None] * k + state.front_slot
    state.hid.copy_(out[rows.reshape(-1)])
