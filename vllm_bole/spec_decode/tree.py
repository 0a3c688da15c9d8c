"""Draft trees and the global node budget.

A :class:`DraftTree` holds one request's proposal below its last sampled token (the root, implicit): node i has
token ``tokens[i]``, parent ``parents[i]`` (-1 = child of the root) and cumulative draft probability
``scores[i]``; parents come before children. vLLM's scheduler sees only ``tokens`` and may cut it to a prefix,
which keeps the tree connected.
"""

from dataclasses import dataclass, field


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
