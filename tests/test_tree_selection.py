"""Draft-tree bookkeeping: global budget selection and greedy tree walking."""

import random

import pytest

from vllm_bole.spec_decode.tree import DraftTree, select_global
from vllm_bole.spec_decode.tree_sampler import walk_tree


def _random_tree(rng, n):
    t = DraftTree()
    for i in range(n):
        p = -1 if i == 0 or rng.random() < 0.2 else rng.randrange(i)
        parent_score = 1.0 if p < 0 else t.scores[p]
        t.tokens.append(rng.randrange(1000))
        t.parents.append(p)
        # Exact ties with the parent happen (probability 1.0 children) and must keep the parent.
        t.scores.append(parent_score * (1.0 if rng.random() < 0.1 else rng.random()))
    return t


@pytest.mark.parametrize("seed", range(20))
def test_global_selection_keeps_connected_best_nodes(seed):
    rng = random.Random(seed)
    trees = [_random_tree(rng, rng.randint(0, 30)) for _ in range(rng.randint(1, 6))]
    budget = rng.randint(0, 60)
    kept = select_global(trees, budget)
    total = sum(len(t) for t in trees)
    assert sum(len(t) for t in kept) == min(budget, total)
    all_scores = sorted((s for t in trees for s in t.scores), reverse=True)
    kept_scores = sorted((s for t in kept for s in t.scores), reverse=True)
    assert kept_scores == all_scores[: len(kept_scores)]
    for t in kept:
        assert all(-1 <= p < i for i, p in enumerate(t.parents))
        for i, p in enumerate(t.parents):
            if p >= 0:
                assert t.scores[p] >= t.scores[i]


def test_selection_keeps_token_paths():
    t = DraftTree([5, 6, 7, 8], [-1, 0, 0, 1], [0.9, 0.5, 0.4, 0.3])
    (kept,) = select_global([t], 3)
    assert kept.tokens == [5, 6, 7] and kept.parents == [-1, 0, 0]


def test_walk_follows_matching_child_under_any_sibling():
    # root 0; children 1 (tok 10), 2 (tok 11); 2 -> 3 (tok 12); 3 -> 4 (tok 13)
    parents = [-1, 0, 0, 2, 3]
    tokens = [-1, 10, 11, 12, 13]
    argmax = [11, 99, 12, 13, 42]
    assert walk_tree(parents, tokens, argmax) == [0, 2, 3, 4]
    argmax[2] = 77
    assert walk_tree(parents, tokens, argmax) == [0, 2]
    assert walk_tree(parents, tokens, [5, 0, 0, 0, 0]) == [0]
    assert walk_tree([-1], [-1], [3]) == [0]


def test_verify_parents_and_depths():
    t = DraftTree([1, 2, 3], [-1, 0, -1], [0.5, 0.2, 0.4])
    assert t.verify_parents() == [-1, 0, 1, 0]
    assert t.depths() == [1, 2, 1]


def _grow(n_reqs, depth, topk, seed, per_request=None, budget=None, ties=False):
    """Grow trees level by level like the MTP drafter (top-``topk`` frontier nodes expand into ``topk`` children
    each); with ``per_request``/``budget`` a node expands only while its score beats its selection floor.
    Child probabilities depend only on the node's path, so pruned and unpruned growth agree node for node."""
    from vllm_bole.spec_decode.mtp_tree_drafter import _Growing
    from vllm_bole.spec_decode.tree import selection_floors

    def child_probs(r, path):
        rng = random.Random(hash((seed, r, path)))
        if ties:  # few distinct values: exact score ties across requests and depths
            return sorted((rng.choice([0.5, 0.25, 1.0]) for _ in range(topk)), reverse=True)
        return sorted((rng.random() for _ in range(topk)), reverse=True)

    trees, paths = [_Growing(req_index=r, next_pos=0) for r in range(n_reqs)], []
    for r, g in enumerate(trees):
        g.add_children(-1, child_probs(r, ()), list(range(topk)))
        paths.append({i: (i,) for i in range(topk)})
    expanded_nodes = 0
    for _ in range(depth - 1):
        floors = (selection_floors([g.tree.scores for g in trees], per_request, budget) if per_request
                  else [float("-inf")] * n_reqs)
        for r, (g, floor) in enumerate(zip(trees, floors)):
            best = [n for n in sorted(g.frontier, key=lambda n: -g.tree.scores[n])[:topk]
                    if g.tree.scores[n] > floor]
            g.frontier = []
            for n in best:
                first = len(g.tree)
                g.add_children(n, child_probs(r, paths[r][n]), [len(g.tree) + j for j in range(topk)])
                paths[r].update({first + j: paths[r][n] + (j,) for j in range(topk)})
                expanded_nodes += 1
    # Token = the node's path, so trees compare by content whatever order the nodes were created in.
    out = []
    for r, g in enumerate(trees):
        t = g.tree
        out.append(DraftTree([hash(paths[r][i]) for i in range(len(t))], list(t.parents), list(t.scores)))
    return out, expanded_nodes


def _content(tree):
    return sorted(zip(tree.tokens, tree.scores))


@pytest.mark.parametrize("n_reqs,depth,topk,per_request,budget,ties", [
    (1, 8, 4, 32, 128, False), (16, 8, 4, 32, 128, False), (16, 8, 4, 32, 40, True), (5, 10, 2, 6, 9, False),
    (3, 6, 3, 100, 1000, False), (8, 7, 4, 12, 16, True), (64, 8, 4, 32, 128, False), (2, 9, 1, 3, 4, True),
    (44, 8, 4, 32, 0, False)])  # a calibrated budget of 0: nothing kept, nothing expanded
def test_pruned_growth_selects_what_full_growth_selects(n_reqs, depth, topk, per_request, budget, ties):
    from vllm_bole.spec_decode.tree import select_step

    for seed in range(3):
        full, full_cost = _grow(n_reqs, depth, topk, seed, ties=ties)
        pruned, pruned_cost = _grow(n_reqs, depth, topk, seed, per_request, budget, ties=ties)
        want = select_step(full, per_request, budget)
        got = select_step(pruned, per_request, budget)
        assert [_content(t) for t in got] == [_content(t) for t in want]
        assert [t.parents for t in got] == [t.parents for t in want]
        assert pruned_cost <= full_cost
    if n_reqs * per_request > budget or depth * topk > per_request:
        assert pruned_cost < full_cost, "the selection floors never cut an expansion"

