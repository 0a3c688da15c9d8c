"""A drafter that plants the true greedy continuation in random trees (tests of exact verification).

``drafter_args``: ``{"oracle": path of a JSON list of {"prompt": [ids], "output": [ids]}, "seed": int,
"stats": optional path}``; with "stats", every proposal appends a JSON line ``{"depth": d, "siblings": [i...],
"tokens": [...], "parents": [...]}`` (planted depth, the sibling index of the true token at each level, and the
tree). For a
request whose tokens so far are a prefix of an oracle entry's prompt + output, each proposed tree hides the
next true tokens along one root path to a random depth (0 = nowhere), at a random sibling position, among
distractor nodes whose tokens differ from the truth at their position. Every acceptance depth and many
commit paths occur; outputs must still equal the oracle exactly.
"""

import json
import random

from vllm_bole.spec_decode.drafter import DraftStep, TreeDrafter
from vllm_bole.spec_decode.tree import DraftTree


class PlantedDrafter(TreeDrafter):
    def __init__(self, runner, bole_config):
        super().__init__(runner, bole_config)
        args = bole_config.drafter_args
        with open(args["oracle"]) as f:
            self.truths = [e["prompt"] + e["output"] for e in json.load(f)]
        self.rng = random.Random(args.get("seed", 0))
        self.vocab = runner.model_config.get_vocab_size()
        self.stats_path = args.get("stats")

    def _truth_after(self, context: list[int]) -> list[int]:
        for t in self.truths:
            if len(t) > len(context) and t[:len(context)] == context:
                return t[len(context):]
        return []

    def _other_token(self, avoid: set[int]) -> int:
        while True:
            tok = self.rng.randrange(self.vocab)
            if tok not in avoid:
                return tok

    def propose(self, step: DraftStep) -> list[DraftTree]:
        cfg = self.bole_config
        trees = []
        for ctx in step.contexts:
            if ctx is None:
                trees.append(DraftTree())
                continue
            truth = self._truth_after(ctx)
            depth = self.rng.randint(0, min(cfg.max_depth, len(truth)))
            tree, siblings = DraftTree(), []
            self._grow(tree, -1, 1, truth, depth, 1.0, siblings)
            trees.append(tree)
            if self.stats_path:
                with open(self.stats_path, "a") as f:
                    f.write(json.dumps({"depth": depth, "siblings": siblings, "tokens": tree.tokens,
                                        "parents": tree.parents}) + "\n")
        return trees

    def _grow(self, tree, parent, level, truth, plant_depth, score, siblings):
        """Add one sibling group under ``parent`` (breadth of 1..topk), recursing under some of them."""
        cfg = self.bole_config
        if level > cfg.max_depth or len(tree) >= cfg.max_nodes_per_request:
            return
        width = self.rng.randint(1, cfg.topk)
        planted = self.rng.randrange(width) if level <= plant_depth else -1
        true_tok = truth[level - 1] if level - 1 < len(truth) else None
        used = {true_tok} if true_tok is not None else set()
        group = []
        for s in range(width):
            if len(tree) >= cfg.max_nodes_per_request:
                break
            tok = true_tok if s == planted else self._other_token(used)
            if s == planted:
                siblings.append(s)
            used.add(tok)
            score_s = score * self.rng.uniform(0.5, 1.0)
            tree.tokens.append(tok)
            tree.parents.append(parent)
            tree.scores.append(score_s)
            group.append((len(tree) - 1, s == planted, score_s))
        for node, is_planted, score_s in group:
            if is_planted:
                self._grow(tree, node, level + 1, truth, plant_depth, score_s, siblings)
            elif self.rng.random() < 0.3:
                self._grow(tree, node, level + 1, [], 0, score_s, [])
