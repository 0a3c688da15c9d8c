"""The device greedy walk against the host walk (``tree_sampler.walk_tree``) on random forests: the same paths,
emitted tokens and deepest nodes, with deep acceptance planted (also under non-first siblings) and repeated sibling
tokens (the host walk follows the first matching child)."""

import random

import pytest
import torch

from forest_shapes import deep_chain_with_branches, make_tree
from vllm_bole.spec_decode.device_walk import greedy_walk
from vllm_bole.spec_decode.tree_sampler import walk_tree

SHAPES = ("single", "chain", "star", "kary2", "kary3", "kary4", "random", "deep")


def _tree(shape: str, t: int, rng: random.Random) -> list[int]:
    return deep_chain_with_branches(t, rng) if shape == "deep" else make_tree(shape, t, rng)


def _depths(parents: list[int]) -> list[int]:
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    return depth


def _case(rng: random.Random, vocab: int):
    """(per tree: parents, tokens, targets, planted depth) with a random node's ancestry planted as the target's
    choices."""
    trees = []
    for _ in range(rng.randint(1, 9)):
        parents = _tree(rng.choice(SHAPES), rng.randint(1, 40), rng)
        tokens = [rng.randrange(vocab) for _ in parents]
        targets = [rng.randrange(vocab) for _ in parents]
        node = rng.randrange(len(parents))   # plant the path to it (any sibling rank)
        planted = _depths(parents)[node]
        while parents[node] >= 0:
            targets[parents[node]] = tokens[node]
            node = parents[node]
        trees.append((parents, tokens, targets, planted))
    return trees


@pytest.mark.parametrize("seed", range(40))
def test_device_walk_matches_the_host_walk(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 8, 1000])   # small vocabularies repeat tokens among siblings
    trees = _case(rng, vocab)
    parent = torch.tensor([p for t in trees for p in t[0]], dtype=torch.int32)
    tokens = torch.tensor([x for t in trees for x in t[1]])
    argmax = torch.tensor([x for t in trees for x in t[2]])
    cu = [0]
    for t in trees:
        cu.append(cu[-1] + len(t[0]))
    depth = max(max(_depths(t[0])) for t in trees)
    walk = greedy_walk(argmax, tokens, parent, torch.tensor(cu, dtype=torch.int32), depth + rng.randint(0, 2))
    paths = walk.host_paths(cu[:-1])
    for i, (parents, toks, targets, planted) in enumerate(trees):
        expected = walk_tree(parents, toks, targets)
        assert paths[i] == expected, (i, parents, toks, targets)
        assert int(walk.deepest[i]) == expected[-1]
        assert int(walk.length[i]) == len(expected)
        emitted = [toks[j] for j in expected[1:]] + [targets[expected[-1]]]
        row = walk.emitted[i].tolist()
        assert row[:len(emitted)] == emitted and all(x == -1 for x in row[len(emitted):])
        assert walk.rows[i, :len(expected)].tolist() == [cu[i] + j for j in expected]
        if vocab == 1000 and len(set(toks)) == len(toks):   # distinct tokens: the planted path is walked
            assert len(expected) - 1 >= planted
    assert walk.rows.shape[1] >= depth + 1


def test_deep_acceptance_under_later_siblings():
    """A full binary tree of depth 5 whose target path always takes the second child: all 5 levels accepted."""
    parents = [-1] + [(i - 1) // 2 for i in range(1, 63)]
    tokens = [0] + [i for i in range(1, 63)]
    targets = [0] * 63
    node, path = 0, [0]
    for _ in range(5):
        child = 2 * node + 2    # the second child
        targets[node] = tokens[child]
        node = child
        path.append(node)
    walk = greedy_walk(torch.tensor(targets), torch.tensor(tokens), torch.tensor(parents, dtype=torch.int32),
                       torch.tensor([0, 63], dtype=torch.int32), 5)
    assert walk.host_paths([0]) == [path]
    assert walk.emitted[0].tolist() == [tokens[j] for j in path[1:]] + [0]
