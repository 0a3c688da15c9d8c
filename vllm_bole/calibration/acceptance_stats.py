"""Acceptance by depth and sibling rank, counted on recorded walks (``spec_decode/walk_record.Walk``).

Every node of an accepted path that has children in its tree is one trial: the target's token there was its
rank-1 child, a lower-ranked child, or none of the children drafted. A child's rank is its order among its
siblings (the drafter's probability order). Ranks past the children drafted are never seen, so they count as
no trial: rank r (>= 2) has a trial where it was drafted and no higher-ranked child was the target's token. These
are the rates ``SyntheticAcceptance`` draws from (``spec_decode/synthetic.py``) and the acceptance model counts
(``spec_decode/acceptance_model.py``):

* ``rank1``: P(rank-1 child accepted | its parent accepted), per depth, over every accepted parent;
* ``siblings``: P(rank r is the target's token | ranks < r were not, rank r drafted), per rank and depth;
* ``chain``: the rank-1 chain alone (parents reached through rank-1 children only). Where a tree's rank-1 chain
  stops before the target rejects it, what a longer chain would have accepted is unseen (a censored trial), so
  the chain's unconditional curve is the product of its conditional rates (Kaplan-Meier) and a k-draft chain's
  mean acceptance length is 1 + the sum of the first k. Without censoring that equals 1 + the mean over the
  trees of min(accepted rank-1 run, k) (``censored`` counts the trees where it is unseen);
* ``tree_budgets``: what each tree's q best nodes (by draft score, ``tree.select_global``'s order) accepted on
  the same steps: the accepted path up to its first node outside them.

Rates come with Wilson 95% intervals. ``synthetic_acceptance`` is what replays the profile: the rank-1 chain's
unconditional curve (vLLM's ``synthetic_acceptance_rates``: a replayed chain of k drafts accepts what the chain
measured) and the sibling ranks' rates pooled over depth, each as far as its trials reach ``min_trials``
(past the list ``SyntheticAcceptance`` repeats the last conditional rate). ``replay`` is what those rates give,
drawn on the recorded trees, against what the trees accepted.
"""

import math
from collections import Counter

from ..spec_decode.synthetic import SyntheticAcceptance
from ..spec_decode.tree import children_of

Z95 = 1.959964


def wilson(hits: float, trials: float) -> list[float] | None:
    """Wilson score 95% interval of a rate of ``hits`` in ``trials`` (None without trials)."""
    if trials <= 0:
        return None
    p = hits / trials
    scale = 1 + Z95 ** 2 / trials
    center = (p + Z95 ** 2 / (2 * trials)) / scale
    half = Z95 * math.sqrt(p * (1 - p) / trials + Z95 ** 2 / (4 * trials ** 2)) / scale
    return [round(max(0.0, center - half), 4), round(min(1.0, center + half), 4)]


def _rate(hits: int, trials: int) -> dict:
    return {"trials": trials, "accepted": hits, "rate": round(hits / trials, 4) if trials else None,
            "ci95": wilson(hits, trials)}


def _ranks_on_path(walk):
    """(depth, children there, rank taken or None) at every path node that has children."""
    children = children_of(walk.parents)
    for j, node in enumerate(walk.path):
        kids = children.get(node)
        if not kids:
            return
        yield j + 1, kids, kids.index(walk.path[j + 1]) if j + 1 < len(walk.path) else None


def consistent(walk) -> bool:
    """Whether the recorded target tokens agree with the walk: each accepted node holds the target's token after
    its parent, and the target's token after the last one is none of its children's."""
    if len(walk.targets) != len(walk.path):
        return False
    children = children_of(walk.parents)
    follows = all(walk.tokens[node] == walk.targets[j] for j, node in enumerate(walk.path[1:]))
    return follows and walk.targets[-1] not in {walk.tokens[c] for c in children.get(walk.path[-1], [])}


def chain_run(walk) -> tuple[int, int]:
    """(rank-1 children accepted from the root in a row, depth of the rank-1 chain drafted from the root)."""
    children = children_of(walk.parents)
    chain = [0]
    while children.get(chain[-1]):
        chain.append(children[chain[-1]][0])
    run = 0
    while run + 1 < min(len(walk.path), len(chain)) and walk.path[run + 1] == chain[run + 1]:
        run += 1
    return run, len(chain) - 1


def budget_accepted(walk, nodes: int) -> int:
    """Tokens the walk accepts within the tree's ``nodes`` best draft nodes (highest score, then shallower, then
    lower index: a connected subtree, as ``tree.select_global`` keeps)."""
    depth = [0] * len(walk.parents)
    for i in range(1, len(walk.parents)):
        depth[i] = depth[walk.parents[i]] + 1
    order = sorted(range(1, len(walk.parents)), key=lambda i: (-walk.scores[i - 1], depth[i], i))
    kept = set(order[:nodes])
    accepted = 0
    for node in walk.path[1:]:
        if node not in kept:
            break
        accepted += 1
    return accepted


def replayed_length(walks: list, rates, sibling_rates, draws: int = 50, seed: int = 0) -> float | None:
    """Mean acceptance length ``SyntheticAcceptance`` with these rates draws on the walks' trees (``draws`` walks
    each); None without rates."""
    if not rates or not walks:
        return None
    synthetic = SyntheticAcceptance(tuple(rates), tuple(sibling_rates), seed)
    accepted = sum(len(synthetic.walk(list(w.parents))) - 1 for w in walks for _ in range(draws))
    return round(1 + accepted / (draws * len(walks)), 4)


def profile_stats(walks: list, max_chain: int = 8, budgets=(1, 2, 4, 8, 16, 32), min_trials: int = 20) -> dict:
    """The profile's measured part (module docstring) from the recorded walks."""
    first_t, first_h = Counter(), Counter()          # depth -> trials, hits
    sib_t, sib_h = Counter(), Counter()              # (rank, depth) -> trials, hits (rank 2 = the second child)
    chain_t, chain_h = Counter(), Counter()          # depth -> trials, hits on the rank-1 chain
    for walk in walks:
        on_chain = True
        for d, kids, rank in _ranks_on_path(walk):
            first_t[d] += 1
            first_h[d] += rank == 0
            if on_chain:
                chain_t[d] += 1
                chain_h[d] += rank == 0
                on_chain = rank == 0
            for r in range(1, len(kids)):
                if rank is not None and rank < r:
                    break
                sib_t[r + 1, d] += 1
                sib_h[r + 1, d] += rank == r
    depths = range(1, max(first_t, default=0) + 1)
    rank1 = [{"depth": d, **_rate(first_h[d], first_t[d])} for d in depths]
    ranks = sorted({r for r, _ in sib_t})
    siblings = [{"rank": r, **_rate(sum(sib_h[r, d] for d in depths), sum(sib_t[r, d] for d in depths))}
                for r in ranks]
    siblings_by_depth = [{"rank": r, "depth": d, **_rate(sib_h[r, d], sib_t[r, d])}
                         for r in ranks for d in depths if sib_t[r, d]]

    chain, survival, curve = [], 1.0, []
    for d in range(1, max(chain_t, default=0) + 1):
        survival *= chain_h[d] / chain_t[d]
        curve.append(survival)
        chain.append({"depth": d, **_rate(chain_h[d], chain_t[d]), "unconditional": round(survival, 4)})
    runs = [chain_run(w) for w in walks]
    chain_lengths = [{"k": k, "mean_acceptance_length": round(1 + sum(curve[:k]), 4),
                      "trees": len(walks) - censored, "censored": censored}
                     for k in range(1, min(max_chain, len(curve)) + 1)
                     for censored in [sum(run == drafted < k for run, drafted in runs)]]

    scored = [w for w in walks if w.scores is not None]
    tree_budgets = [{"nodes": q, "mean_acceptance_length":
                     round(1 + sum(budget_accepted(w, q) for w in scored) / len(scored), 4), "trees": len(scored)}
                    for q in budgets if scored]
    accepted = [len(w.path) - 1 for w in walks]
    tree = {"walks": len(walks), "mean_nodes": round(sum(len(w.parents) - 1 for w in walks) / len(walks), 2),
            "mean_acceptance_length": round(1 + sum(accepted) / len(walks), 4),
            "accepted_per_depth": [sum(a >= d for a in accepted) for d in range(1, max(accepted, default=0) + 1)],
            "inconsistent": sum(not consistent(w) for w in walks)} if walks else {"walks": 0}

    # Rates past too few trials would repeat a noisy conditional rate over every deeper depth.
    rates = [row["unconditional"] for row in chain[:_measured(chain, min_trials)]]
    sibling_rates = [row["rate"] for row in siblings[:_measured(siblings, min_trials)]]
    replay = {"mean_acceptance_length": replayed_length(walks, rates, sibling_rates),
              "measured": tree.get("mean_acceptance_length"), "draws_per_tree": 50}
    return {"synthetic_acceptance": {"rates": rates, "sibling_rates": sibling_rates, "min_trials": min_trials},
            "rank1": rank1, "siblings": siblings, "siblings_by_depth": siblings_by_depth, "chain": chain,
            "chain_acceptance_length": chain_lengths, "tree_budgets": tree_budgets, "tree": tree, "replay": replay}


def _measured(rows: list[dict], min_trials: int) -> int:
    """How many leading rows have at least ``min_trials`` trials."""
    n = 0
    while n < len(rows) and rows[n]["trials"] >= min_trials:
        n += 1
    return n

