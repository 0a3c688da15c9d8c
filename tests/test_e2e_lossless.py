"""Greedy generation with Bole through vLLM equals vLLM without speculation (CPU, tiny Qwen3.5).

Each engine runs in its own process. The planted drafter hides the reference continuation in random trees
(random depth, random sibling position, sometimes nowhere), so every acceptance depth and many commit paths
occur; the MTP drafter runs the real product path.
"""

import json

import pytest

from e2e_support import (assert_graphs_used, assert_lossless, assert_same_logprobs, bole_engine, full_vocab,
                          random_requests, run_engine, tiny_budget_table, write_oracle)
from vllm_bole import envs
from vllm_bole.spec_decode.budget_table import default_budget

pytestmark = pytest.mark.vllm

PROMPT_LENS = [3, 5, 8, 13, 21, 34, 55, 89, 7, 4, 150, 200]
MAX_TOKENS = 40
LONG = len(PROMPT_LENS) - 1  # its max_tokens runs into max_model_len (256)


def _requests(vocab: int):
    reqs = random_requests(vocab, PROMPT_LENS, MAX_TOKENS)
    reqs[LONG]["max_tokens"] = 100
    return reqs


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="module")
def model():
    from vllm_bole.testing.tiny_models import tiny_model_dir

    return tiny_model_dir("qwen3_5")


@pytest.fixture(scope="module")
def requests_(model):
    vocab = json.load(open(f"{model}/config.json"))["text_config"]["vocab_size"]
    return _requests(vocab)


@pytest.fixture(scope="module")
def reference(tmp, model, requests_):
    ref = run_engine(tmp, "ref", {"model": model, "engine": {"max_num_seqs": 16}, "requests": requests_,
                                  "logprobs": 2})
    write_oracle(tmp, requests_, ref)
    assert ref["outputs"][LONG]["finish_reason"] == "length"
    assert len(ref["outputs"][LONG]["tokens"]) == 256 - PROMPT_LENS[LONG]
    return ref


PLANTED = {
    # Global selection: the scheduler waits for the drafts' real tokens.
    "k3_d1": dict(depth=1, topk=3, budget=64, max_num_seqs=16, selection="global"),
    "chain_d3": dict(depth=3, topk=1, budget=512, max_num_seqs=16, selection="global"),
    "k2_d8": dict(depth=8, topk=2, budget=512, max_num_seqs=16, selection="global"),
    "k4_d3_budget24_seqs3": dict(depth=3, topk=4, budget=24, max_num_seqs=3, selection="global"),
    "k2_d3_batch1": dict(depth=3, topk=2, budget=64, max_num_seqs=1, selection="global"),
    # Per-request quotas (the default selection): vLLM schedules placeholder drafts, the step reads the trees from
    # the device.
    "k2_d8_per_request": dict(depth=8, topk=2, budget=512, max_num_seqs=16),
    "k4_d3_budget24_seqs3_per_request": dict(depth=3, topk=4, budget=24, max_num_seqs=3, selection="per_request"),
    # A token budget smaller than the batch's drafts: some requests wait a step (their drafts go stale).
    "k2_d8_per_request_tokens48": dict(depth=8, topk=2, budget=512, max_num_seqs=16, selection="per_request",
                                       max_num_batched_tokens=48),
}


@pytest.mark.parametrize("name", list(PLANTED))
def test_planted_trees_are_lossless(tmp, model, requests_, reference, name):
    cfg = dict(PLANTED[name])
    depth, topk, budget = cfg.pop("depth"), cfg.pop("topk"), cfg.pop("budget")
    out = run_engine(tmp, name, {"model": model, "requests": requests_, "logprobs": 2,
                                 "engine": bole_engine(tmp, name, depth, topk, budget, **cfg)})
    divs = assert_lossless(reference, out, max_near_ties=2)
    print(f"{name}: near-tie divergences {len(divs)}; counters {out['counters']}; graphs {out['bole_graphs']}; "
          f"queued trees {out['queued_trees']}, stale placeholders {out['stale_placeholders']}; "
          f"largest logprob gap {assert_same_logprobs(reference, out):.2e}")
    # Global selection's trees vary in size from step to step: with VLLM_BOLE_CAPTURE_AFTER above 1000 (a GPU run)
    # a step of fewer tokens replays a held larger graph whenever one fits, and the outputs must stay exact.
    assert_graphs_used(out, stand_ins=name == "k2_d8")
    assert out["outputs"][LONG]["finish_reason"] == "length"
    # One GDN state slot per request, conv window of width-1: no per-draft snapshots.
    assert out["mamba_state"] and all(g["num_speculative_blocks"] == 0 for g in out["mamba_state"])
    assert all(g["runner"].startswith("Bole") for g in out["mamba_state"])
    # Per-request quotas: the trees reach the step as placeholders and are read from the device.
    assert (out["queued_trees"] > 0) == (cfg.get("selection", "per_request") == "per_request"), out["queued_trees"]
    per_pos = out["counters"]["accepted_per_pos"]
    assert per_pos[depth - 1] > 0, f"no request accepted a full depth-{depth} path: {per_pos}"
    assert not any(per_pos[depth:]), f"accepted deeper than depth {depth}: {per_pos}"
    stats = [json.loads(line) for line in (tmp / f"{name}.stats.jsonl").read_text().splitlines()]
    assert any(d["depth"] == 0 for d in stats), "no tree without the truth"
    if topk > 1:
        assert any(any(s > 0 for s in d["siblings"]) for d in stats), "truth never under a non-first sibling"


# (selection, max_num_seqs, max_num_batched_tokens). 4 seqs and 48 tokens: waiting requests join the batch in
# the places of finished ones, and their prompts run in chunks (no drafts) between requests that draft.
@pytest.mark.parametrize("selection,seqs,tokens", [("global", 16, None), ("per_request", 16, None),
                                                   ("per_request", 4, 48)])
def test_mtp_tree_drafter_is_lossless_and_accepts(tmp, model, requests_, reference, selection, seqs, tokens):
    # The per-request cases run the drafter's first pass over every verified node before the walk (the default),
    # the global one its catch-up after the walk.
    first_pass = selection == "per_request"
    reqs = [dict(r) for r in requests_]
    reqs.append({"prompt": requests_[3]["prompt"], "max_tokens": 20, "temperature": 0.8, "seed": 7})
    name = f"mtp_{selection}" + (f"_seqs{seqs}_tokens{tokens}" if tokens else "")
    engine = {"max_num_batched_tokens": tokens} if tokens else {}
    engine = full_vocab(bole_engine(tmp, name, depth=3, topk=4, budget="auto", drafter="mtp", selection=selection,
                                    max_num_seqs=seqs, **engine))
    engine["speculative_config"]["early_drafting"] = first_pass
    out = run_engine(tmp, name, {"model": model, "requests": reqs, "logprobs": 2, "engine": engine})
    sampled = out["outputs"].pop()
    assert len(sampled["tokens"]) == 20
    divs = assert_lossless(reference, out, max_near_ties=2)
    counters = out["counters"]
    print(f"{name}: near-tie divergences {len(divs)}; counters {counters}; graphs {out['bole_graphs']}")
    assert_graphs_used(out, drafter=True)
    assert (out["queued_trees"] > 0) == (selection == "per_request"), out["queued_trees"]
    # With the first pass on, it runs once the sampled request is done and every request drafts (the steps
    # before catch up after the walk): both ways are in such a run.
    assert (out["first_pass_steps"] > 0) == first_pass, out["first_pass_steps"]
    # ... and then queues the levels and the commit before the walk too (device walk, device level plan)
    assert (out["early_draft_steps"] > 0) == first_pass, out["early_draft_steps"]
    if tokens:   # ... also where prompt chunks run beside the trees (the chunks' rows by token, with logprobs)
        assert out["early_mixed_steps"] > 0, out["early_mixed_steps"]
    if not envs.VLLM_BOLE_HOST_DRAFT_LEVELS:
        assert out["device_levels"], "the MTP drafter grew no level on the device"
    assert counters["mean_acceptance_length"] > 1.5, counters


def test_first_pass_takes_the_sampled_token_where_it_is(tmp, model, requests_, reference):
    """After a step without trees (prefill chunks; here chunked over steps, with waiting requests joining) the MTP
    drafter's first pass ends in the sampled token, which it takes on the device without the host reading it;
    the same drafter reading it on the host drafts the same trees: equal spec-decode counters, both lossless."""
    counters = {}
    for name, drafter in (("device_tokens", None), ("host_tokens",
                                                    "vllm_bole.testing.host_tokens_drafter:HostTokensMTPDrafter")):
        engine = full_vocab(bole_engine(tmp, name, depth=3, topk=4, budget="auto", drafter="mtp",
                                        selection="per_request", max_num_seqs=4, max_num_batched_tokens=48))
        if drafter is not None:
            engine["speculative_config"]["drafter"] = drafter
        out = run_engine(tmp, name, {"model": model, "requests": requests_, "logprobs": 2, "engine": engine})
        assert_lossless(reference, out, max_near_ties=2)
        counters[name] = out["counters"]
    assert counters["device_tokens"] == counters["host_tokens"], counters
    assert counters["device_tokens"]["mean_acceptance_length"] > 1.5, counters


@pytest.mark.parametrize("selection,asynchronous", [("global", False), ("per_request", False),
                                                  ("per_request", True)])
def test_mtp_chain_steps_are_lossless(tmp, model, requests_, reference, monkeypatch, selection, asynchronous):
    """Steps whose trees hold at most ``VLLM_BOLE_CHAIN_NODES`` nodes grow a one-wide beam (chains of rank-1
    children), the others the full beam: 40 nodes over the batch make chain steps while 10 or more requests draft
    and tree steps once fewer do. Outputs equal vLLM's without speculation: the catch-up after the walk (global), the
    drafting before the walk with queued drafts (per request), and under async scheduling."""
    monkeypatch.setenv("VLLM_BOLE_CHAIN_NODES", "4")
    name = f"mtp_chains_{selection}" + ("_async" if asynchronous else "")
    engine = bole_engine(tmp, name, depth=4, topk=3, budget=40, drafter="mtp", selection=selection, max_num_seqs=16,
                         async_scheduling=asynchronous)
    spec = {"model": model, "requests": requests_, "logprobs": 2, "engine": engine,
            "cpu_async_scheduling": asynchronous}
    out = run_engine(tmp, name, spec)
    assert_lossless(reference, out, max_near_ties=2)
    print(f"{name}: chain steps {out['chain_steps']}, levels {out['device_levels']} (chains {out['chain_levels']})")
    assert out["chain_steps"] > 0 and out["chain_levels"] > 0, out
    assert out["device_levels"] > out["chain_levels"], out   # tree steps too
    assert (out["early_draft_steps"] > 0) == (selection == "per_request"), out["early_draft_steps"]
    assert_graphs_used(out, drafter=True)


def test_mtp_drafter_with_a_draft_vocabulary_is_lossless(tmp, model, requests_, reference):
    """``draft_vocab``: the drafter proposes the lower half of the vocabulary only; the output stays exact (with
    the drafting before the walk, whose walks also feed the default budget rule's acceptance model: a table
    with curves for the tiny model puts the rule "throughput" in charge)."""
    vocab = json.load(open(f"{model}/config.json"))["text_config"]["vocab_size"]
    engine = bole_engine(tmp, "mtp_vocab", depth=3, topk=4, budget="auto", drafter="mtp", max_num_seqs=16)
    engine["speculative_config"] |= {"draft_vocab": vocab // 2,
                                     "budget_table": str(tiny_budget_table(tmp / "table.json", model))}
    out = run_engine(tmp, "mtp_vocab", {"model": model, "requests": requests_, "logprobs": 2, "engine": engine})
    divs = assert_lossless(reference, out, max_near_ties=2)
    counters = out["counters"]
    print(f"mtp_vocab: near-tie divergences {len(divs)}; counters {counters}")
    ids = out["draft_vocab"]
    assert ids is not None and ids[:vocab // 2] == list(range(vocab // 2)) and len(ids) <= vocab // 2 + 2, ids
    assert_graphs_used(out, drafter=True)
    assert counters["num_accepted_tokens"] > 0, counters
    assert out["first_pass_steps"] > 0 and out["early_draft_steps"] > 0, out
    assert out["acceptance_steps"] > 0, out


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_throughput_rule_without_a_table_is_lossless(tmp, model, requests_, reference, asynchronous):
    """``budget_table: "measured"``: the throughput rule in charge without a calibration table, its step clock
    timing whole steps; the budgets move off the start (``budget_table.default_budget``) and the outputs stay
    exact."""
    name = f"mtp_measured_{'async' if asynchronous else 'sync'}"
    engine = bole_engine(tmp, name, depth=3, topk=4, budget="auto", drafter="mtp", max_num_seqs=16,
                         async_scheduling=asynchronous)
    engine["speculative_config"] |= {"budget_table": "measured"}
    out = run_engine(tmp, name, {"model": model, "requests": requests_, "logprobs": 2, "engine": engine,
                                 "cpu_async_scheduling": asynchronous})
    assert_lossless(reference, out, max_near_ties=2)
    planned = out["async_budgets"] if asynchronous else out["budgets"]
    print(f"{name}: budgets {planned}; acceptance steps {out['acceptance_steps']}")
    assert out["acceptance_steps"] > 0, out
    # [batch size, budget, steps]: some budgets are not the start's (the table-less default, at most 12 a request):
    # the rule's
    assert any(n != min(default_budget(b), 12 * b) for b, n, _ in planned), planned


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_mtp_drafter_with_a_learned_draft_vocabulary_is_lossless(tmp, model, requests_, reference, asynchronous):
    """``draft_vocab: "auto"``: the subset starts as the lowest eighth of the ids and moves to the tokens the target
    emits, in place, while the drafter's levels run (graphs on a GPU); the output stays exact and the drafts
    keep being accepted, under vLLM's async scheduling too (the step's first tokens then come from the device)."""
    vocab = json.load(open(f"{model}/config.json"))["text_config"]["vocab_size"]
    name = f"mtp_vocab_auto_{'async' if asynchronous else 'sync'}"
    engine = bole_engine(tmp, name, depth=3, topk=4, budget=48, drafter="mtp", max_num_seqs=16)
    engine["speculative_config"] |= {"draft_vocab": "auto"}
    engine["async_scheduling"] = asynchronous
    out = run_engine(tmp, name, {"model": model, "requests": requests_, "logprobs": 2, "engine": engine,
                                 "cpu_async_scheduling": asynchronous})
    assert out["scheduling"]["async_scheduling"] == asynchronous, out["scheduling"]
    assert_lossless(reference, out, max_near_ties=2)
    ids, counters = out["draft_vocab"], out["counters"]
    print(f"{name}: {out['draft_vocab_refreshes']} refreshes; counters {counters}")
    assert out["draft_vocab_refreshes"] >= 1, out["draft_vocab_refreshes"]
    assert len(ids) <= vocab // 8 + 2 and ids[:vocab // 8] != list(range(vocab // 8)), ids   # it moved
    emitted = {t for r in out["outputs"] for t in r["tokens"]}
    assert len(emitted & set(ids)) >= min(len(emitted), len(ids)) // 2, (sorted(emitted), ids)
    assert counters["num_accepted_tokens"] > 0, counters
    assert_graphs_used(out, drafter=True)


def test_drafting_after_the_walk_when_drafting_before_it_fails(tmp, model, requests_, reference):
    """With the drafting before the walk on, a failure of it (here planted in its third step) leaves that step
    to the drafting after the walk, and turns it off for the engine: the outputs stay exact."""
    engine = bole_engine(tmp, "mtp_fail", depth=3, topk=4, budget="auto", drafter="mtp", max_num_seqs=16)
    engine["speculative_config"] |= {"drafter": "vllm_bole.testing.faulty_drafter:FailOnceBeforeWalk",
                                     "drafter_args": {"fail_at": 3}}
    out = run_engine(tmp, "mtp_fail", {"model": model, "requests": requests_, "logprobs": 2, "engine": engine})
    assert_lossless(reference, out, max_near_ties=2)
    # Three steps drafted (or tried to) before the walk; later ones ran only the first pass before it.
    assert out["early_draft_steps"] == 3 and out["first_pass_steps"] > 3, out
    assert out["counters"]["mean_acceptance_length"] > 1.5, out["counters"]


def test_mixed_steps_draft_after_the_walk_when_drafting_before_it_fails(tmp, model, requests_, reference):
    """Prompt chunks beside trees (at most 4 requests and 48 tokens a step): a failure of such a step's drafting
    before the walk (planted in the second after the start-up warm-up) leaves that step to the drafting after the
    walk, and the later mixed steps too, while steps of trees only still draft before it: the outputs stay exact."""
    engine = bole_engine(tmp, "mtp_fail_mixed", depth=3, topk=4, budget="auto", drafter="mtp", max_num_seqs=4)
    engine["max_num_batched_tokens"] = 48
    engine["speculative_config"] |= {"drafter": "vllm_bole.testing.faulty_drafter:FailOnceBeforeWalk",
                                     "drafter_args": {"fail_at": 2, "mixed": True},
                                     "warmup": True}   # (as on GPUs: its mixed steps must not count)
    out = run_engine(tmp, "mtp_fail_mixed", {"model": model, "requests": requests_, "logprobs": 2,
                                             "engine": engine})
    assert_lossless(reference, out, max_near_ties=2)
    assert out["early_mixed_steps"] == 1, out
    assert out["early_draft_steps"] > 10, out   # (the failed step counts as one)
    assert out["counters"]["mean_acceptance_length"] > 1.5, out["counters"]


def test_phase_timer_keeps_drafting(tmp, model, requests_, reference, monkeypatch):
    """``VLLM_BOLE_PROFILE_STEPS``: with the phase timer on, the drafts are finished inside the drafting call,
    and vLLM keeps what that call returns: the trees still reach the scheduler (they once became no drafts, so
    a profiled engine decoded without speculation), the output stays exact and the timer counts tree steps."""
    monkeypatch.setenv("VLLM_BOLE_PROFILE_STEPS", "4")
    engine = full_vocab(bole_engine(tmp, "profiled", depth=3, topk=4, budget="auto", drafter="mtp", max_num_seqs=16))
    out = run_engine(tmp, "profiled", {"model": model, "requests": requests_, "logprobs": 2, "engine": engine})
    assert_lossless(reference, out, max_near_ties=2)
    counters = out["counters"]
    assert counters["num_drafts"] > 0 and counters["mean_acceptance_length"] > 1.5, counters
    assert out["profiled_steps"] > 0


def test_stop_token_inside_accepted_paths(tmp, model, requests_, reference):
    """Each request stops at a token of its reference continuation; deep planted chains carry tokens past it,
    so the stop lands inside accepted paths and vLLM must cut the output there."""
    reqs, expected = [], []
    for r, out in zip(requests_, reference["outputs"]):
        stop = out["tokens"][7]
        cut = out["tokens"].index(stop) + 1
        reqs.append(dict(r, stop_token_ids=[stop]))
        expected.append(out["tokens"][:cut])
    out = run_engine(tmp, "stop", {"model": model, "requests": reqs,
                                   "engine": bole_engine(tmp, "stop", 8, 1, 512, max_num_seqs=16)})
    assert [o["tokens"] for o in out["outputs"]] == expected
    assert all(o["finish_reason"] == "stop" for o in out["outputs"])
    assert out["counters"]["num_accepted_tokens"] > 0
