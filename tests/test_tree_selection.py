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
