"""Forest helpers (ancestor mask, root paths, depths, validation) and the tree shape generators."""

import random

import pytest
import torch

from forest_shapes import SHAPES, deep_chain_with_branches, make_forest, make_tree
from sequential_gdn import build_forest, seed_of
from vllm_bole.kernels.forest import ancestor_mask, node_depths, path_to_root, validate_forest

ALL_SHAPES = list(SHAPES) + ["deep"]


def brute_ancestors(par, i):
    """Set of i and all its ancestors, by walking parents."""
    out = {i}
    while par[i] >= 0:
        i = par[i]
        out.add(i)
    return out


def tree_of(shape, t, params=()):
    rng = random.Random(seed_of("tree", shape, t, *params))
    return deep_chain_with_branches(t, rng) if shape == "deep" else make_tree(shape, t, rng)


@pytest.mark.parametrize("t", [1, 2, 7, 33])
@pytest.mark.parametrize("shape", ALL_SHAPES)
def test_ancestor_mask_matches_brute_force(shape, t):
    par = tree_of(shape, t)
    mask = ancestor_mask(torch.tensor(par, dtype=torch.int32))
    n = len(par)
    assert mask.shape == (n, n) and mask.dtype == torch.bool
    expected = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in brute_ancestors(par, i):
            expected[i, j] = True
    assert torch.equal(mask, expected)
    assert mask.diagonal().all() and not mask.triu(1).any()


@pytest.mark.parametrize("shape", ALL_SHAPES)
def test_path_to_root(shape):
    par = tree_of(shape, 40)
    parent = torch.tensor(par, dtype=torch.int32)
    assert path_to_root(parent, -1) == []
    for node in range(len(par)):
        path = path_to_root(parent, node)
        assert path[0] >= 0 and par[path[0]] == -1 and path[-1] == node
        assert all(par[c] == p for p, c in zip(path, path[1:]))
        assert set(path) == brute_ancestors(par, node)


def test_node_depths_over_a_forest():
    spec = [("single", 1), ("chain", 9), ("star", 6), ("kary2", 15), ("kary4", 21), ("random", 30),
            ("forest", 25), ("deep", 40)]
    parent, cu = build_forest(spec, random.Random(seed_of("depths")))
    depth = node_depths(parent, cu)
    assert depth.dtype == torch.int32 and depth.shape == parent.shape
    par, cu_l = parent.tolist(), cu.tolist()
    for b in range(len(cu_l) - 1):
        seg = par[cu_l[b]:cu_l[b + 1]]
        for local in range(len(seg)):
            assert depth[cu_l[b] + local] == len(brute_ancestors(seg, local)) - 1
    seg_depth = lambda b: depth[cu_l[b]:cu_l[b + 1]].max().item()
    assert seg_depth(0) == 0 and seg_depth(1) == 8 and seg_depth(2) == 1
    assert seg_depth(3) == 3 and seg_depth(4) == 2      # full binary of 15 nodes, full 4-ary of 21 nodes
    assert seg_depth(7) >= 16                            # deep chain with branches


@pytest.mark.parametrize("k", [2, 3, 4])
def test_kary_trees_are_full_and_breadth_first(k):
    t = 1 + k + k * k + k ** 3
    par = make_tree(f"kary{k}", t, random.Random(0))
    children = [0] * t
    for p in par[1:]:
        children[p] += 1
    assert par[0] == -1 and all(c in (0, k) for c in children)
    assert sum(1 for c in children if c == k) == 1 + k + k * k


@pytest.mark.parametrize("shape", ALL_SHAPES)
def test_generated_shapes_are_valid(shape):
    for t in (1, 2, 5, 64):
        par = tree_of(shape, t, ("valid",))
        assert par[0] == -1 and all(-1 <= p < i for i, p in enumerate(par))
        validate_forest(torch.tensor(par, dtype=torch.int32), torch.tensor([0, len(par)], dtype=torch.int32))
    assert make_tree("single", 10, random.Random(0)) == [-1]
    assert make_tree("chain", 5, random.Random(0)) == [-1, 0, 1, 2, 3]
    assert make_tree("star", 4, random.Random(0)) == [-1, 0, 0, 0]


def test_forest_shape_has_several_roots():
    roots = [sum(p == -1 for p in tree_of("forest", 30, (i,))) for i in range(5)]
    assert all(r >= 1 for r in roots) and max(roots) >= 2


def test_make_forest_packs_local_parents():
    spec = [("chain", 3), ("star", 4), ("single", 1)]
    parent, cu = make_forest(spec, random.Random(0))
    assert cu.tolist() == [0, 3, 7, 8]
    assert parent.tolist() == [-1, 0, 1, -1, 0, 0, 0, -1]
    validate_forest(parent, cu)


def test_validate_accepts_forests_and_empty_segments():
    parent, cu = build_forest([("random", 20), ("forest", 15), ("deep", 36)], random.Random(seed_of("ok")))
    validate_forest(parent, cu)
    validate_forest(torch.tensor([-1, 0, -1], dtype=torch.int32), torch.tensor([0, 2, 2, 3], dtype=torch.int32))
    validate_forest(torch.zeros(0, dtype=torch.int32), torch.tensor([0], dtype=torch.int32))


# (parent, cu_seqlens, index the message must name)
BAD_PARENTS = {
    "self_parent": ([-1, 1, 0], [0, 3], 1),
    "forward_parent": ([-1, 2, 0], [0, 3], 1),
    "root_not_first": ([0, -1], [0, 2], 0),
    "below_minus_one": ([-1, 0, -2], [0, 3], 2),
    "global_index_in_second_request": ([-1, 0, 1, -1, 3], [0, 3, 5], 4),
    "second_request_first_node_not_root": ([-1, 0, 1, 1, 3], [0, 2, 5], 2),
}


@pytest.mark.parametrize("name", list(BAD_PARENTS))
def test_validate_rejects_bad_parents_naming_the_index(name):
    par, cu, bad = BAD_PARENTS[name]
    with pytest.raises(ValueError, match=rf"parent\[{bad}\]={par[bad]}"):
        validate_forest(torch.tensor(par, dtype=torch.int32), torch.tensor(cu, dtype=torch.int32))


@pytest.mark.parametrize("cu", [[1, 3], [0, 2], [0, 4], [0, 3, 1, 3]], ids=["start", "short", "long", "falls"])
def test_validate_rejects_bad_cu_seqlens(cu):
    with pytest.raises(ValueError, match="cu_seqlens"):
        validate_forest(torch.tensor([-1, 0, 0], dtype=torch.int32), torch.tensor(cu, dtype=torch.int32))
