"""The greedy tree walk on the GPU: the one-launch Triton walk against the torch walk (its reference).

    python3 benchmarks/tree_walk.py [--out benchmarks/results/tree_walk.json]

1. Exactness: 300 random forests (1..64 trees of chains, stars, k-ary, random and deep shapes, up to 200 nodes;
   planted paths under any sibling rank; vocabularies of 2..1000 tokens, so siblings repeat tokens): every field
   of the Triton walk equals the torch walk's, and the Triton synthetic targets equal the torch ones from the
   same draws.
2. No host sync: the walks and the synthetic targets run under ``torch.cuda.set_sync_debug_mode("error")``.
3. Time per walk (and per synthetic draw) of B trees of 33 nodes (a root and 4-ary levels), depth bound 8: 200 calls back to back after 20
   warm-up calls, the host time to launch them and the wall time until the GPU is done (both per call). The
   drafting before the walk launches the walk right behind the target forward, so its host time is what the
   host spends before it can queue the drafter's first pass.
Needs no vLLM on the machine (torch and Triton only).
"""

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from forest_shapes import deep_chain_with_branches, make_tree  # noqa: E402

from vllm_bole.kernels.tree_walk.triton_walk import tree_walk  # noqa: E402
from vllm_bole.kernels.tree_walk.triton_walk import synthetic_targets as synthetic_targets_triton  # noqa: E402
from vllm_bole.kernels.tree_walk import reference  # noqa: E402
from vllm_bole.spec_decode.device_walk import _synthetic_rates, greedy_walk, synthetic_targets  # noqa: E402
from vllm_bole.spec_decode.synthetic import SyntheticAcceptance  # noqa: E402

SHAPES = ("single", "chain", "star", "kary2", "kary3", "kary4", "random", "deep")


def _depths(parents):
    out = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def check(cases: int) -> int:
    """Random forests walked both ways; returns the number of mismatching cases."""
    bad = 0
    for seed in range(cases):
        rng = random.Random(seed)
        vocab = rng.choice([2, 3, 8, 1000])
        trees = []
        for _ in range(rng.randint(1, 64)):
            shape, t = rng.choice(SHAPES), rng.randint(1, 200 if seed % 10 == 0 else 40)
            par = deep_chain_with_branches(t, rng) if shape == "deep" else make_tree(shape, t, rng)
            tok = [rng.randrange(vocab) for _ in par]
            tgt = [rng.randrange(vocab) for _ in par]
            node = rng.randrange(len(par))    # plant the path to it (any sibling rank)
            while par[node] >= 0:
                tgt[par[node]] = tok[node]
                node = par[node]
            trees.append((par, tok, tgt))
        parent = torch.tensor([p for t in trees for p in t[0]], dtype=torch.int32).cuda()
        tokens = torch.tensor([x for t in trees for x in t[1]]).cuda()
        argmax = torch.tensor([x for t in trees for x in t[2]]).cuda()
        cu = [0]
        for t in trees:
            cu.append(cu[-1] + len(t[0]))
        max_depth = max(max(_depths(t[0])) for t in trees) + rng.randint(0, 2)
        max_nodes = max(len(t[0]) for t in trees) + rng.choice([0, 3])
        cu = torch.tensor(cu, dtype=torch.int32).cuda()
        bonus = torch.randint(0, 50, argmax.shape, device="cuda") if seed % 2 else argmax
        want = reference.greedy_walk(argmax, tokens, parent, cu, max_depth, bonus)
        got = tree_walk(argmax, tokens, parent, cu, max_depth, bonus, max_nodes)
        # The synthetic targets of the same forest from the same draws, both ways.
        synthetic = SyntheticAcceptance(sibling_rates=((), (0.4,), (0.35, 0.2, 0.1))[seed % 3])
        first, siblings = _synthetic_rates(synthetic, max_depth, "cuda")
        u = torch.rand(parent.numel(), 1 + len(synthetic.sibling_rates), device="cuda")
        pairs = list(zip(want, got, ("rows", "length", "deepest", "emitted")))
        pairs.append((reference.synthetic_targets(tokens, parent, cu, max_depth, u, first, siblings),
                      synthetic_targets_triton(tokens, parent, cu, max_depth, u, first, siblings, max_nodes),
                      "synthetic targets"))
        for b, a, name in pairs:
            if not (a.dtype == b.dtype and torch.equal(a, b)):
                bad += 1
                print(f"mismatch: case {seed}, {name}")
                break
    return bad


def time_walks(batch: int, nodes: int = 33, depth: int = 8) -> dict:
    par = [-1] + [(i - 1) // 4 for i in range(1, nodes)]
    parent = torch.tensor(par * batch, dtype=torch.int32).cuda()
    tokens = torch.randint(0, 9, (nodes * batch,)).cuda()
    argmax = torch.randint(0, 9, (nodes * batch,)).cuda()
    cu = (torch.arange(batch + 1, dtype=torch.int32) * nodes).cuda()
    synthetic = SyntheticAcceptance()
    gen = torch.Generator(device="cuda").manual_seed(0)
    walks = {"triton": lambda: greedy_walk(argmax, tokens, parent, cu, depth, argmax, max_nodes=nodes),
             "torch": lambda: greedy_walk(argmax, tokens, parent, cu, depth, argmax),
             # benchmarks' synthetic targets, drawn before each walk
             "synthetic_triton": lambda: synthetic_targets(tokens, parent, cu, depth, synthetic, gen, max_nodes=nodes),
             "synthetic_torch": lambda: synthetic_targets(tokens, parent, cu, depth, synthetic, gen)}
    for walk in walks.values():   # once before: the rate tables are made on first use
        walk()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")   # raises on an op that waits for the device
    for walk in walks.values():
        walk()
    torch.cuda.set_sync_debug_mode("default")
    row = {"B": batch, "nodes_per_tree": nodes, "depth": depth}
    for name, walk in walks.items():
        for _ in range(20):
            walk()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(200):
            walk()
        host = (time.perf_counter() - start) / 200 * 1e6
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / 200 * 1e6
        row[f"{name}_host_us"], row[f"{name}_wall_us"] = round(host, 1), round(wall, 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/tree_walk.json"))
    parser.add_argument("--cases", type=int, default=300)
    args = parser.parse_args()
    bad = check(args.cases)
    print(f"cases {args.cases}, mismatches {bad}")
    rows = [time_walks(b) for b in (1, 16, 64)]
    names = ("triton", "torch", "synthetic_triton", "synthetic_torch")
    print("| B | " + " | ".join(f"{n} host µs | {n} wall µs" for n in names) + " |")
    print("|---|" + "---|---|" * len(names))
    for r in rows:
        print(f"| {r['B']} | " + " | ".join(f"{r[n + '_host_us']} | {r[n + '_wall_us']}" for n in names) + " |")
    Path(args.out).write_text(json.dumps({"benchmark": "greedy tree walk (benchmarks/tree_walk.py)",
                                          "gpu": torch.cuda.get_device_name(), "cases": args.cases,
                                          "mismatches": bad, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
