"""Acceptance profiles (``vllm-bole acceptance-profile``): the counts on hand-made walks, the profile of a run
through vLLM against vLLM's own counters and against a planted drafter's known trees, and replaying a profile as
synthetic acceptance."""

import json
import os
import subprocess
import sys

import pytest

from vllm_bole.calibration.acceptance_stats import (budget_accepted, consistent, profile_stats, replayed_length,
                                                    wilson)
from vllm_bole.config import BoleConfigError, parse_bole_config
from vllm_bole.spec_decode.synthetic import PROFILE_FORMAT, SyntheticAcceptance, parse_synthetic
from vllm_bole.spec_decode.tree import children_of
from vllm_bole.spec_decode.walk_record import Walk

# A: root children 1 (rank 1), 2 (rank 2); node 1's children 3, 4; node 2's child 5. B: a chain of 3.
# C: the rank-1 chain stops at depth 1 (node 1 has no children), rank 2 goes on.
A = dict(parents=(-1, 0, 0, 1, 1, 2), tokens=(-1, 10, 11, 12, 13, 14), scores=(0.6, 0.3, 0.4, 0.1, 0.2))
B = dict(parents=(-1, 0, 1, 2), tokens=(-1, 20, 21, 22), scores=(0.9, 0.8, 0.7))
C = dict(parents=(-1, 0, 0, 2), tokens=(-1, 30, 31, 32), scores=None)
WALKS = [Walk(**A, path=(0, 1, 4), targets=(10, 13, 99)),     # rank 1, then rank 2
         Walk(**A, path=(0, 2, 5), targets=(11, 14, 7)),      # rank 2, then rank 1
         Walk(**A, path=(0,), targets=(55,)),                 # none of the root's children
         Walk(**B, path=(0, 1, 2, 3), targets=(20, 21, 22, 5)),   # the whole chain, then no child to try
         Walk(**C, path=(0, 1), targets=(30, 8))]             # rank 1, whose chain was drafted no deeper


def _rows(rows, *keys):
    return [tuple(r[k] for k in keys) for r in rows]


def test_counts_by_depth_and_rank_on_hand_made_walks():
    p = profile_stats(WALKS, max_chain=8, budgets=(1, 2, 4, 8), min_trials=1)
    # rank 1 given its parent accepted: depth 1 in all five walks (A1, B, C take it), depth 2 where A1, A2, B
    # reached a node with children (A2 and B take rank 1), depth 3 only B
    assert _rows(p["rank1"], "depth", "trials", "accepted") == [(1, 5, 3), (2, 3, 2), (3, 1, 1)]
    # rank 2: a trial where it was drafted and rank 1 was not taken (A2 takes it, A3 takes nothing; A1 at depth 2)
    assert _rows(p["siblings_by_depth"], "rank", "depth", "trials", "accepted") == [(2, 1, 2, 1), (2, 2, 1, 1)]
    assert _rows(p["siblings"], "rank", "trials", "accepted") == [(2, 3, 2)]
    # the rank-1 chain alone: A2 leaves it at depth 1, C's chain stops (censored past depth 1)
    assert _rows(p["chain"], "depth", "trials", "accepted") == [(1, 5, 3), (2, 2, 1), (3, 1, 1)]
    assert [c["unconditional"] for c in p["chain"]] == [0.6, 0.3, 0.3]
    assert _rows(p["chain_acceptance_length"], "k", "mean_acceptance_length", "censored") == [
        (1, 1.6, 0), (2, 1.9, 1), (3, 2.2, 1)]
    # replayed: the chain's curve and the pooled sibling rates
    assert p["synthetic_acceptance"] == {"rates": [0.6, 0.3, 0.3], "sibling_rates": [0.6667], "min_trials": 1}
    # trees of q best nodes (A's order by score: 1, 3, 2, 5, 4; B's its chain); C has no scores
    assert _rows(p["tree_budgets"], "nodes", "mean_acceptance_length", "trees") == [
        (1, 1.5, 4), (2, 1.75, 4), (4, 2.5, 4), (8, 2.75, 4)]
    assert p["tree"] == {"walks": 5, "mean_nodes": 4.2, "mean_acceptance_length": 2.6,
                         "accepted_per_depth": [4, 3, 1], "inconsistent": 0}
    assert p["replay"]["measured"] == 2.6 and 1.0 < p["replay"]["mean_acceptance_length"] < 4.0


def test_replayed_rates_stop_where_trials_run_short():
    assert profile_stats(WALKS, min_trials=2)["synthetic_acceptance"]["rates"] == [0.6, 0.3]
    assert profile_stats(WALKS, min_trials=3)["synthetic_acceptance"] == {"rates": [0.6], "sibling_rates": [0.6667],
                                                                          "min_trials": 3}
    assert profile_stats(WALKS, min_trials=4)["synthetic_acceptance"]["sibling_rates"] == []
    assert profile_stats(WALKS, min_trials=6)["replay"]["mean_acceptance_length"] is None   # nothing to replay


def test_replay_draws_what_the_rates_say():
    """A chain of 3 replayed with rates 1, 1, 0 accepts 2 tokens; tree A with rank 1 never and rank 2 always taken
    accepts node 2, whose only child is its rank 1."""
    chain = Walk(**B, path=(0,), targets=(0,))
    assert replayed_length([chain], [1.0, 1.0, 0.0], []) == 3.0
    assert replayed_length([WALKS[2]], [0.0], [1.0]) == 2.0


def test_without_censoring_a_chain_accepts_the_mean_of_its_runs():
    walks = WALKS[:4]   # every rank-1 chain drafted as deep as the target followed it
    p = profile_stats(walks)
    runs = [1, 0, 0, 3]
    for row in p["chain_acceptance_length"]:
        assert row["censored"] == 0
        assert row["mean_acceptance_length"] == pytest.approx(1 + sum(min(r, row["k"]) for r in runs) / 4, abs=1e-4)


def test_budget_keeps_the_best_nodes_and_their_path_prefix():
    assert [budget_accepted(WALKS[0], q) for q in (1, 2, 3, 5)] == [1, 1, 1, 2]
    assert [budget_accepted(WALKS[1], q) for q in (1, 3, 4)] == [0, 1, 2]


def test_consistency_of_targets_with_the_walk():
    assert all(consistent(w) for w in WALKS)
    assert not consistent(Walk(**A, path=(0, 1), targets=(11, 3)))      # node 1 is not the target's token
    assert not consistent(Walk(**A, path=(0,), targets=(10,)))          # the target's token was drafted
    assert not consistent(Walk(**A, path=(0, 1), targets=(10,)))        # one target per path node


def test_wilson_intervals():
    assert wilson(0, 10) == [0.0, 0.2775]
    assert wilson(5, 10) == [0.2366, 0.7634]
    assert wilson(10, 10) == [0.7225, 1.0]
    assert wilson(0, 0) is None


def _profile(tmp_path, **block) -> str:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"format": PROFILE_FORMAT, "version": 1, **block}))
    return str(path)


def test_a_profile_replays_as_synthetic_acceptance(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"format": PROFILE_FORMAT, **profile_stats(WALKS, min_trials=1)}))
    syn = parse_synthetic({"profile": str(path), "seed": 3})
    assert (syn.rates, syn.sibling_rates, syn.seed) == ((0.6, 0.3, 0.3), (0.6667,), 3)
    assert SyntheticAcceptance.from_profile(str(path)).rates == (0.6, 0.3, 0.3)
    assert syn.rank1_rate(2) == pytest.approx(0.5) and syn.rank1_rate(3) == pytest.approx(1.0)
    # The engine's processes get the rates, not the path.
    cfg, _ = parse_bole_config({"method": "bole", "synthetic_acceptance": {"profile": str(path), "seed": 3}})
    assert cfg.synthetic_acceptance == {"rates": [0.6, 0.3, 0.3], "sibling_rates": [0.6667], "seed": 3}
    assert parse_synthetic(cfg.synthetic_acceptance) == syn


@pytest.mark.parametrize("content, value, match", [
    (None, {"profile": "absent.json"}, "synthetic_acceptance.profile: cannot read"),
    ("{not json", None, "synthetic_acceptance.profile: .* is not JSON"),
    (json.dumps({"format": "other"}), None, "is not an acceptance profile"),
    (json.dumps([1, 2]), None, "is not an acceptance profile"),
    (json.dumps({"format": PROFILE_FORMAT}), None, "needs \"synthetic_acceptance\""),
    (json.dumps({"format": PROFILE_FORMAT, "synthetic_acceptance": {"rates": [0.5]}}), None,
     "needs \"synthetic_acceptance\""),
    (json.dumps({"format": PROFILE_FORMAT, "synthetic_acceptance": {"rates": [1.5], "sibling_rates": []}}), None,
     r"rates must be numbers in \[0, 1\]"),
    (json.dumps({"format": PROFILE_FORMAT, "synthetic_acceptance": {"rates": [], "sibling_rates": []}}), None,
     r"rates must be numbers in \[0, 1\]"),
    (json.dumps({"format": PROFILE_FORMAT, "synthetic_acceptance": {"rates": [0.5, 0.6], "sibling_rates": []}}),
     None, "must be non-increasing"),
    (None, {"profile": 3}, "synthetic_acceptance.profile must be the path"),
    (None, {"profile": "x.json", "rates": [0.5]}, "'profile' or 'rates' and 'sibling_rates', not both"),
    (None, {"profile": "x.json", "seed": "1"}, "synthetic_acceptance.seed must be an integer"),
])
def test_bad_profiles_fail_in_one_line(tmp_path, content, value, match):
    if content is not None:
        (tmp_path / "bad.json").write_text(content)
        value = {"profile": str(tmp_path / "bad.json")}
    with pytest.raises(BoleConfigError, match=match) as e:
        parse_bole_config({"method": "bole", "synthetic_acceptance": value})
    assert "\n" not in str(e.value)


def test_e2e_takes_its_rates_from_a_profile(tmp_path):
    from e2e_support import load_benchmark

    e2e = load_benchmark("e2e")
    path = _profile(tmp_path, synthetic_acceptance={"rates": [0.9, 0.7, 0.5], "sibling_rates": [0.4, 0.2]})
    argv = ["--acceptance-profile", path]
    args = e2e.build_parser().parse_args(argv)
    e2e.apply_acceptance_profile(args, argv)
    assert (args.rates, args.sibling_rates) == ([0.9, 0.7, 0.5], [0.4, 0.2])
    argv = ["--acceptance-profile", path, "--rates", "0.5"]
    with pytest.raises(SystemExit, match="either, not both"):
        e2e.apply_acceptance_profile(e2e.build_parser().parse_args(argv), argv)
    argv = ["--acceptance-profile", str(tmp_path / "absent.json")]
    with pytest.raises(SystemExit, match="^--acceptance-profile: cannot read"):
        e2e.apply_acceptance_profile(e2e.build_parser().parse_args(argv), argv)


def test_walks_are_recorded_only_when_asked(monkeypatch):
    from vllm_bole import envs

    monkeypatch.delenv("VLLM_BOLE_RECORD_WALKS", raising=False)
    assert envs.VLLM_BOLE_RECORD_WALKS is False
    monkeypatch.setenv("VLLM_BOLE_RECORD_WALKS", "1")
    assert envs.VLLM_BOLE_RECORD_WALKS is True


def test_prompts_from_lines_or_a_json_list(tmp_path):
    from vllm_bole.calibration.acceptance_profile import default_prompts, read_prompts

    path = tmp_path / "p.txt"
    path.write_text("first prompt\n\n  second one\n")
    assert read_prompts(str(path)) == ["first prompt", "  second one"]
    path.write_text(json.dumps(["a", [1, 2, 3]]))
    assert read_prompts(str(path)) == ["a", [1, 2, 3]]
    for bad in ("[1, 2", json.dumps([]), json.dumps([["x"]]), json.dumps([""])):
        path.write_text(bad)
        with pytest.raises(SystemExit, match="^--prompts: "):
            read_prompts(str(path))
    prompts = default_prompts()
    assert len(prompts) == 18 and prompts[1] == "In the morning the market opens early."


# ---- through vLLM ----------------------------------------------------------------------------------------------

def _cli(tmp_path, model: str, *extra: str) -> tuple[dict, list[Walk]]:
    from vllm_bole.testing.tiny_models import engine_kwargs

    out, walks = tmp_path / "profile.json", tmp_path / "walks.jsonl"
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run([sys.executable, "-m", "vllm_bole.cli", "acceptance-profile", "--model", model,
                           "--engine-args", json.dumps(engine_kwargs("qwen3_5")), "--out", str(out),
                           "--walks", str(walks), *extra], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "rank-1 chain, unconditional per depth" in proc.stdout
    recorded = [Walk(**{k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(line).items()})
                for line in walks.read_text().splitlines()]
    return json.loads(out.read_text()), recorded


@pytest.mark.vllm
def test_mtp_chain_profile_matches_vllms_counters(tmp_path, tiny_qwen3_5_dir):
    """Top-1 trees (chains of 4) from the MTP head, drafted before the walk: the profile's counts are vLLM's
    spec-decode counters, and a chain of k drafts accepts the mean of min(accepted, k) over the steps."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The river starts high in the hills\n\nA garden teaches patience\nHello there, my name is\n"
                       "Computers are machines that follow instructions.\nIn the morning the market opens early\n")
    p, walks = _cli(tmp_path, tiny_qwen3_5_dir, "--prompts", str(prompts), "--depth", "4", "--topk", "1",
                    "--max-tokens", "24", "--ignore-eos", "--min-trials", "1")
    c, depth = p["vllm_counters"], 4
    n = c["num_drafts"]
    assert p["prompts"] == 5 and n == len(walks) == p["tree"]["walks"] > 0
    assert p["unrecorded_steps"] == 0 and p["tree"]["inconsistent"] == 0
    assert all(len(w.parents) == depth + 1 and w.scores is not None for w in walks)
    accepted = [len(w.path) - 1 for w in walks]
    # the number of rank-1 acceptances at depth d is the number of steps accepting at least d tokens
    per_depth = [sum(a >= d for a in accepted) for d in range(1, depth + 1)]
    assert per_depth == c["accepted_per_pos"] == [r["accepted"] for r in p["rank1"]] == \
        [r["accepted"] for r in p["chain"]]
    assert c["num_accepted_tokens"] == sum(accepted) and c["num_draft_tokens"] == depth * n
    assert p["synthetic_acceptance"]["rates"] == pytest.approx([a / n for a in per_depth], abs=1e-4)
    assert p["synthetic_acceptance"]["sibling_rates"] == [] and p["siblings"] == []
    for row in p["chain_acceptance_length"]:
        expected = 1 + sum(min(a, row["k"]) for a in accepted) / n
        assert row["censored"] == 0 and row["mean_acceptance_length"] == pytest.approx(expected, abs=1e-4)
    assert p["tree"]["mean_acceptance_length"] == pytest.approx(c["mean_acceptance_length"], abs=1e-4)
    # a chain's q best nodes are its first q
    chain = {r["k"]: r["mean_acceptance_length"] for r in p["chain_acceptance_length"]}
    assert {b["nodes"]: b["mean_acceptance_length"] for b in p["tree_budgets"]} == {q: chain[q] for q in (1, 2, 4)}


@pytest.mark.vllm
def test_planted_trees_give_their_planted_ranks(tmp_path, tiny_qwen3_5_dir):
    """The planted drafter hides the true continuation at known sibling ranks to a known depth (host trees,
    walked on the host): every recorded walk is one of its trees and accepts exactly what it planted, and the
    profile counts what those plantings imply."""
    from e2e_support import random_requests, run_engine, vocab_size, write_oracle

    requests = random_requests(vocab_size(tiny_qwen3_5_dir), [9, 14, 20, 11], max_tokens=24)
    ref = run_engine(tmp_path, "plain", {"model": tiny_qwen3_5_dir, "requests": requests})
    oracle, stats = write_oracle(tmp_path, requests, ref), tmp_path / "planted.stats.jsonl"
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([r["prompt"] for r in requests]))
    spec = {"drafter": "vllm_bole.testing.planted_drafter:PlantedDrafter",
            "drafter_args": {"oracle": str(oracle), "seed": 7, "stats": str(stats)}}
    p, walks = _cli(tmp_path, tiny_qwen3_5_dir, "--prompts", str(prompts), "--depth", "4", "--topk", "3",
                    "--max-tokens", "24", "--ignore-eos", "--speculative-config", json.dumps(spec))

    planted = {}
    for line in stats.read_text().splitlines():
        e = json.loads(line)
        planted.setdefault((tuple(e["tokens"]), tuple(e["parents"])), []).append(e)
    expected = []
    for w in walks:
        e = planted[w.tokens[1:], tuple(p - 1 if p > 0 else -1 for p in w.parents[1:])].pop()
        children, path = children_of(list(w.parents)), [0]
        for s in e["siblings"]:
            path.append(children[path[-1]][s])
        assert list(w.path) == path, (w, e)   # accepted exactly what was planted, at the planted ranks
        expected.append(Walk(w.parents, w.tokens, w.scores, tuple(path), w.targets))
    assert sum(map(len, planted.values())) <= len(requests)   # each request's last trees are never verified
    want = profile_stats(expected, max_chain=4, budgets=(1, 2, 4, 8, 12))
    for key in ("rank1", "siblings", "siblings_by_depth", "chain", "chain_acceptance_length", "synthetic_acceptance",
                "tree_budgets", "tree", "replay"):
        assert p[key] == want[key], key
    assert [r["rank"] for r in p["siblings"]] == [2, 3] and all(r["accepted"] > 0 for r in p["siblings"])
    c = p["vllm_counters"]
    assert c["num_drafts"] == len(walks) and c["accepted_per_pos"] == p["tree"]["accepted_per_depth"] + [0] * (
        4 - len(p["tree"]["accepted_per_depth"]))
