"""Synthetic acceptance (benchmarks at real shapes): rates, validation, and a run through vLLM."""

import pytest

from forest_shapes import full_tree
from vllm_bole.config import BoleConfigError, parse_bole_config
from vllm_bole.spec_decode.synthetic import SyntheticAcceptance, parse_synthetic


def test_rates_are_followed_per_depth_and_rank():
    syn = SyntheticAcceptance(rates=(0.9, 0.5), sibling_rates=(0.4,), seed=1)   # conditional 0.9, then 5/9
    parents = full_tree(2, 3)
    n = 20000
    depth_counts = [0, 0, 0, 0]
    rank1_at_depth1 = 0
    for _ in range(n):
        path = syn.walk(parents)
        depth_counts[len(path) - 1] += 1
        if len(path) > 1 and path[1] == 2:  # the second child of the root
            rank1_at_depth1 += 1
    reach1 = 0.9 + 0.1 * 0.4
    reach2 = reach1 * (5 / 9 + 4 / 9 * 0.4)
    assert abs(sum(depth_counts[1:]) / n - reach1) < 0.01
    assert abs(sum(depth_counts[2:]) / n - reach2) < 0.01
    assert abs(rank1_at_depth1 / n - 0.1 * 0.4) < 0.006


@pytest.mark.parametrize("coverage", [1.0, 0.7])
def test_child_probability_is_the_walks_frequency(coverage):
    syn = SyntheticAcceptance(rates=(0.8, 0.6), sibling_rates=(0.5, 0.25), seed=3,   # conditional 0.8, 0.75
                              draft_vocab_coverage=coverage)
    parents = full_tree(4, 2)          # root children 1..4, each with 4 children
    n = 40000
    first_rank, second_rank = [0] * 4, [0] * 4
    for _ in range(n):
        path = syn.walk(parents)
        if len(path) > 1:
            first_rank[path[1] - 1] += 1
        if len(path) > 2 and path[1] == 1:
            second_rank[(path[2] - 5) % 4] += 1
    for rank in range(4):
        assert abs(first_rank[rank] / n - syn.child_probability(1, rank)) < 0.01
        assert abs(second_rank[rank] / n - syn.child_probability(1, 0) * syn.child_probability(2, rank)) < 0.01
    assert syn.child_probability(1, 3) == 0.0                 # only two sibling rates
    assert syn.child_probability(5, 0) == syn.child_probability(2, 0) == pytest.approx(0.75 * coverage)   # repeats
    assert syn.rank1_rate(2) == pytest.approx(0.75 * coverage) and syn.in_vocab_rank1_rate(2) == pytest.approx(0.75)
    assert sum(syn.child_probability(2, r) for r in range(3)) == pytest.approx(
        coverage * (0.75 + 0.25 * (0.5 + 0.5 * 0.25)))


def test_draft_vocab_coverage_discounts_every_depth():
    """A chain under coverage c reaches depth d with rates[d-1] * c**d: each accepted token had to be one the
    drafter could propose. Coverage 1 draws exactly as before (no extra draw)."""
    rates = (0.9, 0.8, 0.6)
    chain = [-1, 0, 1, 2]
    syn = SyntheticAcceptance(rates=rates, sibling_rates=(), seed=7, draft_vocab_coverage=0.8)
    n = 40000
    depths = [len(syn.walk(chain)) - 1 for _ in range(n)]
    for d, rate in enumerate(rates, start=1):
        assert abs(sum(x >= d for x in depths) / n - rate * 0.8 ** d) < 0.01
    plain, full = SyntheticAcceptance(rates=rates, seed=7), SyntheticAcceptance(rates=rates, seed=7,
                                                                                  draft_vocab_coverage=1.0)
    assert [plain.walk(chain) for _ in range(200)] == [full.walk(chain) for _ in range(200)]


def test_a_chain_accepts_like_vllms_synthetic_chain():
    """rates are vLLM's unconditional per-position rates: a one-wide tree reaches depth d with rates[d-1]."""
    rates = (0.917, 0.837, 0.648, 0.538)
    syn = SyntheticAcceptance(rates=rates, sibling_rates=(0.35,), seed=5)
    chain = [-1, 0, 1, 2, 3]
    n = 40000
    depths = [len(syn.walk(chain)) - 1 for _ in range(n)]
    for d, rate in enumerate(rates, start=1):
        assert abs(sum(x >= d for x in depths) / n - rate) < 0.01


def test_missing_rank_stops_the_walk():
    syn = SyntheticAcceptance(rates=(0.0,), sibling_rates=(1.0,), seed=0)
    assert syn.walk([-1, 0]) == [0]           # rank 2 drawn, only one child
    assert syn.walk([-1, 0, 0]) == [0, 2]


@pytest.mark.parametrize("value", ["yes", {"rates": [1.5]}, {"rate": [0.5]}, {"rates": []}, {"rates": [0.5, 0.6]},
                                   {"draft_vocab_coverage": 0}, {"draft_vocab_coverage": 1.2},
                                   {"draft_vocab_coverage": True}, {"draft_vocab_coverage": "0.9"}])
def test_bad_values_name_the_field(value):
    with pytest.raises(BoleConfigError, match="synthetic_acceptance"):
        parse_bole_config({"method": "bole", "draft_vocab": 64, "synthetic_acceptance": value})


def test_draft_vocab_coverage_needs_a_draft_vocab():
    with pytest.raises(BoleConfigError, match="draft_vocab_coverage applies only with draft_vocab"):
        parse_bole_config({"method": "bole", "draft_vocab": None,
                           "synthetic_acceptance": {"draft_vocab_coverage": 0.9}})
    cfg, _ = parse_bole_config({"method": "bole", "synthetic_acceptance": {"draft_vocab_coverage": 0.9}})   # "auto"
    assert parse_synthetic(cfg.synthetic_acceptance).draft_vocab_coverage == 0.9
    cfg, _ = parse_bole_config({"method": "bole", "draft_vocab": 64, "synthetic_acceptance": {
        "draft_vocab_coverage": 0.9}})
    assert parse_synthetic(cfg.synthetic_acceptance).draft_vocab_coverage == 0.9


def test_defaults():
    syn = parse_synthetic(True)
    assert syn.rates[:3] == (0.917, 0.837, 0.648) and syn.sibling_rates == (0.35, 0.2, 0.1)
    assert parse_synthetic(None) is None


@pytest.mark.vllm
@pytest.mark.parametrize("before_walk", [False, True])
def test_synthetic_run_through_vllm(tmp_path, before_walk):
    """Also with the drafting queued before the walk (``early_drafting``, the default), where the synthetic targets are
    drawn on the device."""
    import json

    from e2e_support import bole_engine, random_requests, run_engine
    from vllm_bole.testing.tiny_models import tiny_model_dir

    model = tiny_model_dir("qwen3_5")
    vocab = json.load(open(f"{model}/config.json"))["text_config"]["vocab_size"]
    engine = bole_engine(tmp_path, "syn", 4, 2, 256, drafter="mtp", max_num_seqs=8)
    engine["speculative_config"] |= {"synthetic_acceptance": {"rates": [0.9, 0.8, 0.7, 0.6], "seed": 3},
                                     "early_drafting": before_walk}
    out = run_engine(tmp_path, "syn", {"model": model, "engine": engine,
                                       "requests": random_requests(vocab, [5, 9, 30, 12, 7, 3, 20, 16],
                                                                   max_tokens=64)})
    c = out["counters"]
    per_pos = [a / c["num_drafts"] for a in c["accepted_per_pos"][:4]]
    expected = [0.9 + 0.1 * 0.35]
    for rate in (0.8 / 0.9, 0.7 / 0.8, 0.6 / 0.7):   # conditional rank-1 rates of the unconditional list
        expected.append(expected[-1] * (rate + (1 - rate) * 0.35))
    print("synthetic per-depth acceptance", per_pos, "expected about", expected)
    assert all(len(o["tokens"]) == 64 for o in out["outputs"])
    assert (out["early_draft_steps"] > 0) == before_walk, out["early_draft_steps"]
    # Both depth-1 children are always in the tree; deeper, a drawn rank may be missing (only the best nodes of
    # a level are expanded and each request keeps 8 nodes), which can only lower acceptance.
    assert abs(per_pos[0] - expected[0]) < 0.08, (per_pos, expected)
    for got, want in zip(per_pos[1:], expected[1:]):
        assert 0 < got < want + 0.08, (per_pos, expected)
