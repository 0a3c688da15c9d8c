"""Every verified tree and its walk, kept while ``VLLM_BOLE_RECORD_WALKS=1``: ``vllm-bole acceptance-profile``
measures acceptance by depth and sibling rank from them (``calibration/acceptance_stats.py``).

Off by default: the runner then holds no log, and a walk costs one attribute check. Steps whose paths never reach
the host (async scheduling keeps them on the device) are only counted, in ``unrecorded_steps``.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Walk:
    """One request's verified tree and what the target did with it. Node 0 is the root (the last emitted token),
    draft node i of the drafter's tree is node i + 1, and siblings keep the drafter's order, its probability
    order: a child's index among its siblings is its rank."""

    parents: tuple[int, ...]           # per node, its parent (-1: the root)
    tokens: tuple[int, ...]            # per node, its token (the root's is -1: the forest does not hold it)
    scores: tuple[float, ...] | None   # per draft node (node i + 1), its cumulative draft probability; None: unknown
    path: tuple[int, ...]              # accepted nodes, root first
    targets: tuple[int, ...]           # the target's token after each path node: what the step emitted


class WalkLog:
    def __init__(self):
        self.walks: list[Walk] = []
        self.unrecorded_steps = 0

    def add_step(self, forest, emitted: list[list[int]], trees: dict) -> None:
        """One walked step: ``forest`` (its ``StepForest``, accepted paths set), the tokens each of its trees
        emitted (forest order) and the drafter's trees by request id, for their scores. Trees of a root alone
        (decodes without drafts run as trees in a CUDA graph) hold nothing to measure."""
        for i, path in enumerate(forest.accepted_paths):
            parents, tokens = forest.parents_of(i), forest.tokens[i]
            if len(parents) < 2:
                continue
            drafted = list(tokens[1:])
            tree = trees.get(forest.req_ids[i])
            # vLLM may verify a prefix of the drafter's tree, or a chain Bole did not draft (stale placeholders)
            same = tree is not None and list(tree.tokens[:len(drafted)]) == drafted
            scores = tuple(float(s) for s in tree.scores[:len(drafted)]) if same else None
            self.walks.append(Walk(tuple(parents), tuple(tokens), scores, tuple(path), tuple(emitted[i])))
