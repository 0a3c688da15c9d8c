"""Draft trees and the global node budget.

A :class:`DraftTree` holds one request's proposal below its last sampled token (the root, implicit): node i has
token ``tokens[i]``, parent ``parents[i]`` (-1 = child of the root) and cumulative draft probability
``scores[i]``; parents come before children. vLLM's scheduler sees only ``tokens`` and may cut it to a prefix,
which keeps the tree connected.
"""

from dataclasses import dataclass, field

import numpy as np


@dataclass
class DraftTree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return d

    def truncated(self, n: int) -> "DraftTree":
        return DraftTree(self.tokens[:n], self.parents[:n], self.scores[:n])

    def padded(self, n: int, token: int = 0) -> "DraftTree":
        """At least ``n`` nodes: the missing ones as children of the root holding ``token`` (score 0, so they
        come last). For verification slots fixed before the drafts were made (async scheduling): a padding
        node is checked like any draft, so it is accepted only where the target emits its token anyway."""
        extra = max(0, n - len(self))
        return DraftTree(self.tokens + [token] * extra, self.parents + [-1] * extra, self.scores + [0.0] * extra)

    def verify_parents(self) -> list[int]:
        """Parents in the verification tree, where node 0 is the root and draft node i is node i + 1."""
        return [-1] + [p + 1 for p in self.parents]


def children_of(parents: list[int]) -> dict[int, list[int]]:
    """Each node's children, in node order (for a drafter's tree: its probability order)."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        if p >= 0:
            children.setdefault(p, []).append(i)
    return children


def select_global(trees: list[DraftTree], budget: int) -> list[DraftTree]:
    """Keep the ``budget`` highest-scoring nodes over all requests.

    Scores never rise from parent to child and ties go to the shallower node, so every kept node's ancestors
    are kept too: the result is a forest of connected trees, each in its original parents-first order.
    """
    ranked = sorted(
        ((-score, depth, r, i) for r, t in enumerate(trees) for i, (score, depth) in enumerate(
            zip(t.scores, t.depths()))))
    keep = [set() for _ in trees]
    for _, _, r, i in ranked[:budget]:
        keep[r].add(i)
    out = []
    for t, k in zip(trees, keep):
        new_index = {}
        tree = DraftTree()
        for i in range(len(t)):
            if i not in k:
                continue
            p = t.parents[i]
            assert p < 0 or p in new_index, "scores must not rise from a parent to its child"
            new_index[i] = len(tree)
            tree.tokens.append(t.tokens[i])
            tree.parents.append(-1 if p < 0 else new_index[p])
            tree.scores.append(t.scores[i])
        out.append(tree)
    return out


def select_step(trees: list[DraftTree], per_request: int, budget: int) -> list[DraftTree]:
    """The trees a step verifies: each request's ``per_request`` best nodes, then ``budget`` over all."""
    return select_global([select_global([t], per_request)[0] for t in trees], budget)


def selection_floors(scores: list[list[float]], per_request: int, budget: int | None) -> list[float]:
    """Per request, a score that a node added later (deeper than every node there now, with a score no higher
    than its parent's) must exceed to be kept by :func:`select_step`; ``-inf`` while there is room.

    A later node loses every tie (``select_global`` prefers the shallower node), so it is cut if its score is
    at most the ``per_request``-th best of its request or, once the requests' best nodes fill the budget, the
    ``budget``-th best of those; the nodes it would push out of its request rank below it and were not kept.
    """
    floors, best = [], []
    for s in scores:
        s = np.asarray(s, dtype=np.float64)
        if len(s) >= per_request:
            s = np.partition(s, len(s) - per_request)[len(s) - per_request:]
            floors.append(float(s.min()))
        else:
            floors.append(-np.inf)
        best.append(s)
    if budget is not None:
        if budget <= 0:  # nothing is kept (a calibrated budget may be 0 where trees never pay)
            return [np.inf] * len(floors)
        pooled = np.concatenate(best) if best else np.zeros(0)
        if len(pooled) >= budget:
            cut = float(np.partition(pooled, len(pooled) - budget)[len(pooled) - budget])
            floors = [max(f, cut) for f in floors]
    return floors

