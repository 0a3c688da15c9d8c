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


def _packed(trees):
    """(parent, tokens, argmax, cu_seqlens as a list, deepest depth) of a case's trees, packed."""
    parent = torch.tensor([p for t in trees for p in t[0]], dtype=torch.int32)
    tokens = torch.tensor([x for t in trees for x in t[1]])
    argmax = torch.tensor([x for t in trees for x in t[2]])
    cu = [0]
    for t in trees:
        cu.append(cu[-1] + len(t[0]))
    return parent, tokens, argmax, cu, max(max(_depths(t[0])) for t in trees)


@pytest.mark.parametrize("seed", range(40))
def test_device_walk_matches_the_host_walk(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 8, 1000])   # small vocabularies repeat tokens among siblings
    trees = _case(rng, vocab)
    parent, tokens, argmax, cu, depth = _packed(trees)
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


def _triton_walk(argmax, tokens, parent, cu, max_depth, bonus, max_nodes):
    """The Triton walk (the interpreter without a GPU) as a DeviceWalk on the host."""
    from triton_modes import DEV, import_kernel_modules, interpreter

    from vllm_bole.spec_decode.device_walk import DeviceWalk

    (mod,) = import_kernel_modules("vllm_bole.kernels.tree_walk.triton_walk")
    with interpreter():
        out = mod.tree_walk(*(t.to(DEV) for t in (argmax, tokens, parent, cu)), max_depth, bonus.to(DEV), max_nodes)
    return DeviceWalk(*(t.cpu() for t in out))


@pytest.mark.parametrize("seed", range(24))
def test_triton_walk_is_the_torch_walk(seed):
    """The one-launch Triton walk against the torch walk (its reference) on random forests: chains, stars, k-ary,
    random and deep trees, planted paths under any sibling rank, repeated sibling tokens, a loose depth bound and a
    loose size bound (padded tiles)."""
    from vllm_bole.kernels.tree_walk import reference
    from vllm_bole.spec_decode.device_walk import DeviceWalk

    rng = random.Random(100 + seed)
    trees = _case(rng, rng.choice([2, 3, 8, 1000]))
    parent, tokens, argmax, cu, depth = _packed(trees)
    cu = torch.tensor(cu, dtype=torch.int32)
    max_depth = depth + rng.randint(0, 2)
    bonus = torch.randint(0, 50, argmax.shape) if seed % 2 else argmax
    max_nodes = max(len(t[0]) for t in trees) + rng.choice([0, 0, 5, 40])
    want = DeviceWalk(*reference.greedy_walk(argmax, tokens, parent, cu, max_depth, bonus))
    got = _triton_walk(argmax, tokens, parent, cu, max_depth, bonus, max_nodes)
    for name in ("rows", "length", "deepest", "emitted"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), (name, a, b)
    assert max(got.length.tolist()) >= 1


def test_triton_walk_goes_deep_under_later_siblings_and_leaves_empty_trees_empty():
    """A full binary tree of depth 5 walked through second children to the bottom, beside a one-node tree and an
    empty (padding) segment, which gets length 0 and no path."""
    parents = [-1] + [(i - 1) // 2 for i in range(1, 63)]
    tokens = [0] + list(range(1, 63))
    targets = [0] * 63
    node, path = 0, [0]
    for _ in range(5):
        targets[node] = tokens[2 * node + 2]
        node = 2 * node + 2
        path.append(node)
    parent = torch.tensor(parents + [-1], dtype=torch.int32)
    tok, tgt = torch.tensor(tokens + [7]), torch.tensor(targets + [9])
    cu = torch.tensor([0, 63, 64, 64], dtype=torch.int32)
    walk = _triton_walk(tgt, tok, parent, cu, 5, tgt, 63)
    assert walk.length.tolist() == [6, 1, 0]
    assert walk.rows[0].tolist() == path and walk.rows[1].tolist() == [63] + [-1] * 5
    assert walk.rows[2].tolist() == [-1] * 6 and walk.emitted[2].tolist() == [-1] * 6
    assert walk.emitted[0].tolist() == [tokens[j] for j in path[1:]] + [0]
    assert walk.emitted[1].tolist() == [9] + [-1] * 5
    assert walk.deepest.tolist()[:2] == [path[-1], 0]


@pytest.mark.parametrize("seed", range(16))
def test_triton_synthetic_targets_are_the_torch_targets(seed):
    """The one-launch synthetic targets against the torch ones from the same draws: random forests (siblings up to
    k-ary 4 and stars, so ranks past the drawn ones occur), rate lists shorter and longer than the depth, no
    sibling rates at all, and a loose size bound."""
    from triton_modes import DEV, import_kernel_modules, interpreter

    from vllm_bole.kernels.tree_walk import reference
    from vllm_bole.spec_decode.device_walk import _synthetic_rates
    from vllm_bole.spec_decode.synthetic import SyntheticAcceptance

    rng = random.Random(200 + seed)
    trees = _case(rng, 1000)
    parent, tokens, _, cu, depth = _packed(trees)
    cu = torch.tensor(cu, dtype=torch.int32)
    siblings = [(), (0.4,), (0.35, 0.2, 0.1), (0.9, 0.9)][seed % 4]
    synthetic = SyntheticAcceptance(rates=tuple(sorted((rng.random() for _ in range(rng.randint(1, 9))),
                                                       reverse=True)), sibling_rates=siblings, seed=seed)
    max_depth = depth + rng.randint(0, 2)
    u = torch.rand(parent.numel(), 1 + len(siblings), generator=torch.Generator().manual_seed(seed))
    first, sib = _synthetic_rates(synthetic, max_depth, "cpu")
    want = reference.synthetic_targets(tokens, parent, cu, max_depth, u, first, sib)
    (mod,) = import_kernel_modules("vllm_bole.kernels.tree_walk.triton_walk")
    with interpreter():
        got = mod.synthetic_targets(*(t.to(DEV) for t in (tokens, parent, cu)), max_depth, u.to(DEV), first.to(DEV),
                                    sib.to(DEV), max(len(t[0]) for t in trees) + rng.choice([0, 7])).cpu()
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert bool((want >= 0).any()) or len(siblings) == 0 or parent.numel() == len(trees)


def test_triton_walk_refuses_trees_past_its_tile():
    """Trees larger than the Triton walk's tile limit are refused there (``greedy_walk`` sends them to torch)."""
    from vllm_bole.kernels.tree_walk.triton_walk import MAX_TREE_NODES, tree_walk

    with pytest.raises(ValueError, match="256"):
        tree_walk(*(torch.zeros(1, dtype=torch.long),) * 2, torch.zeros(1, dtype=torch.int32),
                  torch.tensor([0, 1], dtype=torch.int32), 1, torch.zeros(1, dtype=torch.long), MAX_TREE_NODES + 1)


@pytest.mark.parametrize("seed", range(10))
def test_walked_moves_are_the_host_paths_moves(seed):
    """The KV moves of a device walk (kv_compaction.walked_row_moves) are the host paths' moves, in path order."""
    from types import SimpleNamespace

    from vllm_bole.worker.kv_compaction import accepted_row_moves, walked_row_moves

    rng = random.Random(seed)
    trees = _case(rng, rng.choice([3, 1000]))
    parent, tokens, argmax, cu, depth = _packed(trees)
    walk = greedy_walk(argmax, tokens, parent, torch.tensor(cu, dtype=torch.int32), depth)
    forest = SimpleNamespace(accepted_paths=walk.host_paths(cu[:-1]), query_starts=cu[:-1])
    src, dst = walked_row_moves(walk, torch.tensor(cu[:-1]))
    keep = src >= 0
    assert bool(((src >= 0) == (dst >= 0)).all())
    assert (src[keep].tolist(), dst[keep].tolist()) == accepted_row_moves(forest)


@pytest.mark.parametrize("coverage", [1.0, 0.85])
def test_synthetic_targets_accept_like_the_host_synthetic_walk(coverage):
    """Synthetic acceptance on the device: the accepted depth and the rank path of full 3-ary trees follow the
    host walk's distribution (``SyntheticAcceptance.walk``), over many trees; also with a draft vocabulary's
    coverage below 1."""
    from collections import Counter

    from vllm_bole.spec_decode.device_walk import synthetic_targets
    from vllm_bole.spec_decode.synthetic import SyntheticAcceptance

    synthetic = SyntheticAcceptance(rates=(0.9, 0.7, 0.5, 0.3), sibling_rates=(0.4, 0.25), seed=3,
                                    draft_vocab_coverage=coverage)
    parents = [-1] + [(i - 1) // 3 for i in range(1, 121)]           # full 3-ary tree of depth 4
    trees = 3000
    parent = torch.tensor(parents * trees, dtype=torch.int32)
    tokens = torch.tensor(list(range(len(parents))) * trees)
    cu = torch.arange(trees + 1, dtype=torch.int32) * len(parents)
    gen = torch.Generator().manual_seed(0)
    targets = synthetic_targets(tokens, parent, cu, 4, synthetic, gen)
    walk = greedy_walk(targets, tokens, parent, cu, 4, bonus=torch.zeros_like(tokens))
    device = Counter(tuple(p) for p in walk.host_paths(cu[:-1].tolist()))
    host = Counter(tuple(synthetic.walk(parents)) for _ in range(trees))
    # Paths by sibling ranks: compare the frequencies of the commonest ones (3000 draws: ~0.03 sampling error).
    for path, count in host.most_common(8):
        assert abs(device[path] - count) / trees < 0.04, (path, device[path], count)
    mean = lambda c: sum((len(p) - 1) * n for p, n in c.items()) / trees   # noqa: E731
    assert abs(mean(device) - mean(host)) < 0.08, (mean(device), mean(host))
    assert max(len(p) for p in device) == 5      # deep acceptance occurs
    assert all(t == 0 for t in walk.emitted.gather(1, (walk.length - 1)[:, None]).flatten().tolist())   # bonus


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs exist on CUDA only")
def test_walk_and_synthetic_targets_queue_without_waiting():
    """The runner queues the walk (and, benchmarking, the synthetic targets) behind the target forward before
    the host reads anything: no op of theirs may wait for the device (a masked index would)."""
    from vllm_bole.spec_decode.device_walk import synthetic_targets
    from vllm_bole.spec_decode.synthetic import SyntheticAcceptance

    rng = random.Random(5)
    parent, tokens, argmax, cu, depth = _packed(_case(rng, 8))
    parent, tokens, argmax = parent.cuda(), tokens.cuda(), argmax.cuda()
    largest = max(b - a for a, b in zip(cu, cu[1:]))
    cu = torch.tensor(cu, dtype=torch.int32).cuda()
    synthetic = SyntheticAcceptance(rates=(0.9, 0.7), sibling_rates=(0.4,), seed=0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    synthetic_targets(tokens, parent, cu, depth, synthetic, gen)   # the rate tables are made on first use
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        targets = synthetic_targets(tokens, parent, cu, depth, synthetic, gen)
        fused_targets = synthetic_targets(tokens, parent, cu, depth, synthetic, gen, max_nodes=largest)
        walk = greedy_walk(targets, tokens, parent, cu, depth, bonus=argmax)
        fused = greedy_walk(targets, tokens, parent, cu, depth, bonus=argmax, max_nodes=largest)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert walk.rows.shape == (cu.numel() - 1, depth + 1)
    assert bool((walk.length >= 1).all())
    assert torch.equal(walk.rows, fused.rows) and torch.equal(walk.emitted, fused.emitted)
    assert fused_targets.shape == targets.shape and fused_targets.dtype == targets.dtype
