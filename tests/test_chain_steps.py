"""Chain steps: where the selection would keep a chain of rank-1 children anyway, the MTP drafter grows a one-wide
beam (``DraftStep.width`` 1, ``BudgetPolicy.width``), one query per request and level instead of ``topk``."""

import heapq
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_bole.config import parse_bole_config
from vllm_bole.spec_decode.acceptance_model import AcceptanceModel, chain_nodes, child_probability
from vllm_bole.spec_decode.device_beam import DeviceBeam
from vllm_bole.spec_decode.drafter import DraftStep
from vllm_bole.spec_decode.synthetic import SyntheticAcceptance
from vllm_bole.worker.budget_policy import BudgetPolicy, synthetic_chain_nodes
from vllm_bole.worker.drafting import nodes_per_tree

from test_device_beam import _stand_in


def _best_first_is_chain(first, sib, k, depth, q) -> bool:
    """Brute force: whether the q most probable nodes (ties to the chain's disfavour) are the rank-1 chain."""
    heap = [(-child_probability(first, sib, 1, r), r == 0, 1, r == 0) for r in range(k)]
    heapq.heapify(heap)
    for _ in range(q):
        p, _, d, on_chain = heapq.heappop(heap)
        if not on_chain or -p <= 0:
            return False
        if d < depth:
            for r in range(k):
                heapq.heappush(heap, (p * child_probability(first, sib, d + 1, r), on_chain and r == 0, d + 1,
                                      on_chain and r == 0))
    return True


@pytest.mark.parametrize("first,sib,k,depth", [
    ([0.917, 0.913, 0.774, 0.830, 0.838, 0.772, 0.862, 0.862], [0.35, 0.2, 0.1], 4, 8),   # the synthetic defaults
    ([0.6] * 8, [0.35, 0.2, 0.1], 4, 8),
    ([0.9, 0.5, 0.9, 0.9], [0.9], 2, 4),
    ([0.3, 0.9, 0.9], [0.5, 0.4], 3, 3),
    ([0.95] * 6, [], 1, 6),
])
def test_chain_nodes_is_where_the_best_first_tree_stops_being_a_chain(first, sib, k, depth):
    n = chain_nodes(first, sib, k, depth)
    assert all(_best_first_is_chain(first, sib, k, depth, q) for q in range(1, n + 1))
    assert n == depth or not _best_first_is_chain(first, sib, k, depth, n + 1)


def test_chain_nodes_of_the_synthetic_defaults_and_of_the_measured_rates():
    cfg = parse_bole_config({"method": "bole", "synthetic_acceptance": True})[0]
    assert synthetic_chain_nodes(cfg) == cfg.max_depth == 8   # siblings never beat the rank-1 chain there
    assert synthetic_chain_nodes(parse_bole_config({"method": "bole"})[0]) == 0
    model = AcceptanceModel(topk=4, max_depth=8)
    # walks of trees whose root has two children: the rank-1 child taken 3 times in 5, the rank-2 one twice
    parents = [[-1, 0, 0]]
    for _ in range(40):
        model.observe(parents * 5, [[0, 1]] * 3 + [[0, 2]] * 2)
    first, sib = model.rates()
    assert first[0] == pytest.approx(0.6) and sib[0] == pytest.approx(1.0)
    assert model.chain_nodes() == 1   # the root's rank-2 child (0.4) beats the chain's second node (0.36)


def _policy(spec: dict, ready=False, chain=None) -> BudgetPolicy:
    policy = BudgetPolicy.__new__(BudgetPolicy)
    policy.config = parse_bole_config({"method": "bole", **spec})[0]
    policy.acceptance = SimpleNamespace(ready=ready, chain_nodes=lambda: chain)
    policy._synthetic_chain_nodes = synthetic_chain_nodes(policy.config)
    return policy


def test_the_policy_asks_for_chains_up_to_the_chain_nodes(monkeypatch):
    monkeypatch.delenv("VLLM_BOLE_CHAIN_NODES", raising=False)
    synthetic = _policy({"synthetic_acceptance": True})
    assert [synthetic.width(q) for q in (0, 1, 8, 9, 32)] == [None, 1, 1, None, None]
    assert _policy({}).width(2) is None                       # no rates: the full beam
    measured = _policy({"synthetic_acceptance": True}, ready=True, chain=3)   # measurements before the config
    assert [measured.width(q) for q in (3, 4)] == [1, None]
    assert _policy({"topk": 1, "synthetic_acceptance": True}).width(2) is None   # every beam is one wide
    shallow = _policy({"num_speculative_tokens": 3, "topk": 4}, ready=True, chain=10)
    assert [shallow.width(q) for q in (3, 4)] == [1, None]   # a chain holds max_depth nodes at most
    monkeypatch.setenv("VLLM_BOLE_CHAIN_NODES", "0")
    assert synthetic.width(1) is None
    monkeypatch.setenv("VLLM_BOLE_CHAIN_NODES", "5")
    assert [_policy({}).width(q) for q in (5, 6)] == [1, None]
    monkeypatch.setenv("VLLM_BOLE_CHAIN_NODES", "two")
    with pytest.raises(ValueError, match="VLLM_BOLE_CHAIN_NODES must be a non-negative integer"):
        synthetic.width(1)


def test_nodes_per_tree_of_a_step():
    step = DraftStep(req_ids=["a", "b", "c"], contexts=[[1], [2], None], per_request=12, budget=5)
    assert nodes_per_tree(step) == 3            # 5 nodes over 2 drafting requests
    step.budget = 100
    assert nodes_per_tree(step) == 12           # the per-request cap
    step.quotas = [4, 2, 0]
    assert nodes_per_tree(step) == 4            # the largest quota
    assert nodes_per_tree(DraftStep(req_ids=["a"], contexts=[None], per_request=12,
                                                          budget=8)) == 0


def _expected_chain(drafter, hidden: float, length: int, synthetic=None):
    """The rank-1 chain the stand-in's MTP forward and top children give from a root's hidden state: tokens and
    cumulative scores (the drafter's probabilities, or the synthetic rates of rank 1)."""
    k = drafter.bole_config.topk
    h, score, tokens, scores = torch.tensor([[hidden]]), 1.0, [], []
    for d in range(1, length + 1):
        top = drafter._top_rows(h)[0]
        tok = int(top[k])
        score *= float(top[0]) if synthetic is None else synthetic.rank1_rate(d)
        tokens.append(tok)
        scores.append(score)
        h = torch.tensor([[float((int(h[0, 0]) * 1000003 + tok) % (1 << 22))]])
    return tokens, scores


@pytest.mark.parametrize("synthetic", [None, SyntheticAcceptance(rates=(0.9, 0.8, 0.7), sibling_rates=(0.35,))])
@pytest.mark.parametrize("quotas", [False, True])
def test_a_one_wide_beam_grows_the_rank1_chain(synthetic, quotas):
    k, depth = 4, 6
    drafter = _stand_in(k, depth, synthetic)
    reqs, roots = [0, 3, 5], [17, 40, 230]
    hidden = torch.tensor([[float(7 + 13 * r)] for r in reqs])
    for q in (1, 3, depth):
        drafter.levels = []
        step = DraftStep(req_ids=[f"r{r}" for r in range(6)], contexts=[], per_request=q, budget=None)
        if quotas:
            step.quotas, step.fill_quotas = [q if r in reqs else 0 for r in range(6)], True
        trees = DeviceBeam(drafter, width=1).grow(step, None, reqs, roots, hidden)
        for tree, h in zip(trees, hidden[:, 0].tolist()):
            tokens, scores = _expected_chain(drafter, h, q, synthetic)
            assert tree.parents == list(range(-1, q - 1)) and tree.tokens == tokens
            assert np.allclose(tree.scores, scores, rtol=1e-6)
        assert len(drafter.levels) == q - 1
        assert all(len(level["tokens"]) == len(reqs) for level in drafter.levels)   # one query per request
        if quotas:
            assert step.queued.counts == [q] * len(reqs)
