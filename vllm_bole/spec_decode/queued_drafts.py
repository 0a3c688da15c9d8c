"""Drafts that stay on the device between steps (``selection: "per_request"``).

With per-request quotas every request's node count is known when the drafter is queued, before its nodes are.
vLLM's scheduler then gets placeholder drafts of those lengths (token id -1, as its own async scheduling uses)
and schedules the next step while the device still drafts; the runner writes the real tokens, RoPE positions and
tree parents into the step's inputs from these tensors, on the device, and reads the trees on the host only when
it walks them after the forward.

Row ``g`` of the tensors holds the tree of request ``req_ids[g]``: its ``counts[g]`` nodes in parents-first order
(the order of :class:`~.tree.DraftTree`), padded to the widest tree.
"""

from dataclasses import dataclass

import torch
from vllm.utils.torch_utils import async_tensor_h2d

from .tree import DraftTree, select_global

PLACEHOLDER = -1   # the draft token id vLLM's scheduler sees (its async scheduling's placeholder)


@dataclass
class QueuedDrafts:
    req_ids: list[str]
    counts: list[int]            # nodes of each request's tree
    tokens: torch.Tensor         # [G, Q] int64 node tokens
    parents: torch.Tensor        # [G, Q] int64 local parents (-1: child of the root)
    depths: torch.Tensor         # [G, Q] int64 depth below the root (1: child of the root)

    def __post_init__(self):
        self.row_of = {req_id: g for g, req_id in enumerate(self.req_ids)}

    def count(self, req_id: str) -> int:
        g = self.row_of.get(req_id)
        return 0 if g is None else self.counts[g]

    def placeholder_ids(self, req_ids: list[str]) -> list[list[int]]:
        """The draft token ids vLLM gets for ``req_ids``: placeholders of each tree's length."""
        return [[PLACEHOLDER] * self.count(req_id) for req_id in req_ids]

    @classmethod
    def of_trees(cls, req_ids: list[str], trees: list[DraftTree], device) -> "QueuedDrafts":
        """Host trees (e.g. a drafter that builds them on the host) as queued drafts: one copy to the device."""
        width = max([len(t) for t in trees] + [1])
        flat = torch.zeros(3, len(trees), width, dtype=torch.int64)
        for g, tree in enumerate(trees):
            n = len(tree)
            flat[0, g, :n] = torch.tensor(tree.tokens, dtype=torch.int64)
            flat[1, g, :n] = torch.tensor(tree.parents, dtype=torch.int64)
            flat[2, g, :n] = torch.tensor(tree.depths(), dtype=torch.int64)
        flat = async_tensor_h2d(flat, device)
        return cls(req_ids=list(req_ids), counts=[len(t) for t in trees], tokens=flat[0], parents=flat[1],
                   depths=flat[2])


def quotas_of(drafting: list[bool], per_request: int, budget: int | None) -> list[int]:
    """Per batch request, the nodes its tree gets: the budget split evenly over the drafting requests (the first
    ones get the remainder), at most ``per_request`` each; 0 for the others."""
    n = sum(drafting)
    if budget is None or n == 0:
        return [per_request if d else 0 for d in drafting]
    base, extra = divmod(max(budget, 0), n)
    out, i = [], 0
    for d in drafting:
        if d:
            out.append(min(per_request, base + (i < extra)))
            i += 1
        else:
            out.append(0)
    return out


def select_quotas(trees: list[DraftTree], quotas: list[int]) -> list[DraftTree]:
    """Each tree's ``quotas[i]`` best nodes (``tree.select_global`` per tree: a connected tree)."""
    return [select_global([t], q)[0] for t, q in zip(trees, quotas)]
