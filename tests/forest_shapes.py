"""Random and named tree shapes for kernel tests: parent arrays with parents before children."""

import random

import torch

SHAPES = ("single", "chain", "star", "kary2", "kary3", "kary4", "random", "forest")


def make_tree(shape: str, t: int, rng: random.Random) -> list[int]:
    """Local parent list of ``t`` nodes (``t`` is ignored for "single")."""
    if shape == "single":
        return [-1]
    if shape == "chain":
        return [-1] + list(range(t - 1))
    if shape == "star":
        return [-1] + [0] * (t - 1)
    if shape.startswith("kary"):
        k = int(shape[4:])
        return [-1] + [(i - 1) // k for i in range(1, t)]  # breadth-first full k-ary tree
    if shape == "random":
        return [-1] + [rng.randrange(i) for i in range(1, t)]
    if shape == "forest":  # several roots hanging off the prefix
        return [-1 if i == 0 or rng.random() < 0.2 else rng.randrange(i) for i in range(t)]
    raise ValueError(f"unknown shape {shape!r}")


def full_tree(k: int, depth: int) -> list[int]:
    """Parents of the full k-ary tree of ``depth`` levels below its root (node 0), breadth first: each node's
    children are contiguous, in rank order."""
    return make_tree(f"kary{k}", sum(k ** d for d in range(depth + 1)), random.Random(0))


def make_forest(shapes_and_sizes, rng: random.Random, device="cpu"):
    """Pack several trees: returns (parent [N] int32, cu_seqlens [B+1] int32)."""
    parents, cu = [], [0]
    for shape, t in shapes_and_sizes:
        tree = make_tree(shape, t, rng)
        parents += tree
        cu.append(cu[-1] + len(tree))
    return (torch.tensor(parents, dtype=torch.int32, device=device),
            torch.tensor(cu, dtype=torch.int32, device=device))


def deep_chain_with_branches(t: int, rng: random.Random) -> list[int]:
    """A spine of depth ~t/2 with random side branches: depth 16+ at t >= 32."""
    spine = t // 2
    tree = [-1] + list(range(spine - 1))
    tree += [rng.randrange(len(tree)) for _ in range(t - spine)]
    # Side nodes attach to earlier nodes only, so parents still precede children.
    return tree
