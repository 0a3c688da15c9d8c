"""A drafter proposing trees of a set size and shape, for timing verification (calibration, budget tests).

``drafter_args``: ``{"nodes": n, "shape": "beam" | "kary" | "chain", "seed": s}``. Every drafting request gets
a tree of ``nodes`` nodes (default: the per-request maximum, depth x topk); in-process callers may instead set
``total_nodes`` between engine steps, which splits that many nodes over the drafting requests (the first ones
get one more when it does not divide). Shapes, with the engine's ``topk`` and depth limit:

* ``beam``: ``topk`` nodes per level, each level the children of the previous level's first node (a rank-1
  spine with its siblings, the shape of a well-predicted MTP tree);
* ``kary``: the complete ``topk``-ary tree filled level by level (widest, shallowest);
* ``chain``: one path.

Node scores fall in node order, so the per-request and per-step budgets keep a prefix of each tree. Tokens are
random: pair it with synthetic acceptance (``{"rates": [0.0], "sibling_rates": []}``) to verify every tree and
accept none of it, so the shape stays fixed step after step.
"""

import random

from ..spec_decode.drafter import DraftStep, TreeDrafter, drafting
from ..spec_decode.tree import DraftTree

SHAPES = ("beam", "kary", "chain")


def max_shape_nodes(shape: str, topk: int, max_depth: int) -> int:
    if shape == "beam":
        return topk * max_depth
    if shape == "kary":
        return sum(topk ** d for d in range(1, max_depth + 1))
    return max_depth


def shape_parents(shape: str, n: int, topk: int, max_depth: int) -> list[int]:
    """Parents (-1: the root) of an ``n``-node tree of ``shape``, parents first."""
    if shape not in SHAPES:
        raise ValueError(f"drafter_args.shape must be one of {list(SHAPES)}, got {shape!r}")
    n = min(n, max_shape_nodes(shape, topk, max_depth))
    if shape == "chain":
        return list(range(-1, n - 1))
    if shape == "beam":
        return [-1 if i < topk else (i // topk - 1) * topk for i in range(n)]
    return [-1 if i < topk else i // topk - 1 for i in range(n)]


class FixedShapeDrafter(TreeDrafter):
    def __init__(self, runner, bole_config):
        super().__init__(runner, bole_config)
        args = bole_config.drafter_args
        self.shape = args.get("shape", "beam")
        shape_parents(self.shape, 0, 1, 1)  # validates the shape
        self.nodes_per_request = int(args.get("nodes", bole_config.max_nodes_per_request))
        self.total_nodes: int | None = None
        self.rng = random.Random(args.get("seed", 0))
        self.vocab = runner.model_config.get_vocab_size()

    def _sizes(self, num_drafting: int) -> list[int]:
        if self.total_nodes is None:
            return [self.nodes_per_request] * num_drafting
        base, extra = divmod(self.total_nodes, max(num_drafting, 1))
        return [base + (i < extra) for i in range(num_drafting)]

    def propose(self, step: DraftStep) -> list[DraftTree]:
        cfg = self.bole_config
        drafts = drafting(step.contexts)
        sizes = iter(self._sizes(sum(drafts)))
        trees = []
        for drafts_r in drafts:
            if not drafts_r:
                trees.append(DraftTree())
                continue
            parents = shape_parents(self.shape, next(sizes), cfg.topk, cfg.max_depth)
            trees.append(DraftTree(tokens=[self.rng.randrange(self.vocab) for _ in parents], parents=parents,
                                   scores=[1.0 - i / (len(parents) + 1) for i in range(len(parents))]))
        return trees
