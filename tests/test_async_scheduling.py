"""Bole under vLLM's async scheduling (engine ``async_scheduling=True``), on CPU through ``engine_run``'s
``cpu_async_scheduling`` (vLLM 0.26 turns async scheduling off on CPU; the harness keeps it on).

The scheduler places each request's next tree as placeholder drafts before the step that drafts it
(``BoleAsyncScheduler``), the runner drafts exactly that many nodes and writes them in on the device, and the
early path's tokens stay on the device. Greedy outputs must equal vLLM without speculation, every placeholder must
have had its tree (no stale chains), and acceptance must match the synchronous engine's: inputs the drafter reads
from optimistic host counts would only lower acceptance, never change the output.
"""

import json

import pytest

from e2e_support import (assert_graphs_used, assert_lossless, assert_same_logprobs, bole_engine, full_vocab,
                          random_requests, run_engine, vocab_size, write_oracle)

pytestmark = pytest.mark.vllm

PROMPT_LENS = [3, 8, 21, 55, 13, 34, 200]
MAX_TOKENS = 32
LONG = len(PROMPT_LENS) - 1   # runs into max_model_len (256): its last steps do not fit the drafter


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("async")


@pytest.fixture(scope="module")
def model(tiny_qwen3_5_dir):
    return tiny_qwen3_5_dir


@pytest.fixture(scope="module")
def requests_(model):
    reqs = random_requests(vocab_size(model), PROMPT_LENS, MAX_TOKENS, seed=77)
    reqs[LONG]["max_tokens"] = 100
    return reqs


@pytest.fixture(scope="module")
def reference(tmp, model, requests_):
    ref = run_engine(tmp, "ref", {"model": model, "engine": {"max_num_seqs": 8}, "requests": requests_,
                                  "logprobs": 2})
    write_oracle(tmp, requests_, ref)
    assert len(ref["outputs"][LONG]["tokens"]) == 256 - PROMPT_LENS[LONG]
    return ref


def _run(tmp, model, requests_, name, engine, asynchronous):
    engine = engine | {"async_scheduling": asynchronous}
    return run_engine(tmp, name, {"model": model, "requests": requests_, "logprobs": 2, "engine": engine,
                                  "cpu_async_scheduling": asynchronous})


def test_sampled_requests_and_logprobs_run_async(tmp, model, requests_, reference):
    """A sampled request beside greedy ones (its trees are walked by draws), no logprobs (the early path's
    tokens stay on the device) and a request that runs into max_model_len (its last steps do not fit the drafter):
    the greedy outputs are exact, the sampled one runs to its length."""
    reqs = [dict(r) for r in requests_] + [{"prompt": requests_[2]["prompt"], "max_tokens": 20,
                                            "temperature": 0.8, "seed": 7}]
    engine = bole_engine(tmp, "mtp_sampled", depth=3, topk=2, budget=48, drafter="mtp", max_num_seqs=8)
    out = run_engine(tmp, "mtp_sampled", {"model": model, "requests": reqs, "cpu_async_scheduling": True,
                                          "engine": engine | {"async_scheduling": True}})
    _assert_async(out)
    sampled = out["outputs"].pop()
    assert len(sampled["tokens"]) == 20
    assert [o["tokens"] for o in out["outputs"]] == [o["tokens"] for o in reference["outputs"]]
    assert out["early_draft_steps"] > 0 and out["outputs"][LONG]["finish_reason"] == "length", out
    # Without logprobs the early steps hand vLLM their tokens on the device (no host copy of the walk).
    assert out["device_output_steps"] == out["early_draft_steps"], out


def test_prompt_chunks_beside_trees_draft_early_async(tmp, model, requests_, reference, monkeypatch):
    """At most 4 requests and 48 tokens a step: waiting requests join in the places of finished ones and their
    prompts run in chunks beside the others' trees. Such mixed steps draft before the walk too (the completed
    prompts' first trees from their last rows), here with an unseeded sampled request among them and no logprobs,
    so their tokens stay on the device: the greedy outputs are exact and every placeholder has its tree. Without the
    sampled request, and with logprobs (the walks reach the host), every verified tree is exactly the drafting
    after the walk's (``early_drafting: false``): the chunks' rows gave the drafter the inputs its catch-up gives."""
    monkeypatch.setenv("VLLM_BOLE_RECORD_WALKS", "1")
    requests_, reference = _short(requests_, reference)
    sampled = {"prompt": requests_[2]["prompt"], "max_tokens": 20, "temperature": 0.8}
    engine = full_vocab(bole_engine(tmp, "mtp_mixed", depth=3, topk=2, budget=24, drafter="mtp", max_num_seqs=4))
    engine |= {"max_num_batched_tokens": 48, "async_scheduling": True}
    late = dict(engine, speculative_config=engine["speculative_config"] | {"early_drafting": False})
    runs = {name: run_engine(tmp, name, {"model": model, "requests": reqs, "cpu_async_scheduling": True,
                                         "engine": spec, "logprobs": logprobs})
            for name, reqs, spec, logprobs in [("mtp_mixed_sampled", requests_ + [sampled], engine, None),
                                               ("mtp_mixed", requests_, engine, 2),
                                               ("mtp_mixed_late", requests_, late, 2)]}
    out, greedy, late = runs.values()
    for run in runs.values():
        _assert_async(run)
    assert len(out["outputs"].pop()["tokens"]) == 20
    for run in (out, greedy, late):
        assert [o["tokens"] for o in run["outputs"]] == [o["tokens"] for o in reference["outputs"]]
    print(f"mtp_mixed: counters {greedy['counters']}; early {greedy['early_draft_steps']}, mixed "
          f"{greedy['early_mixed_steps']}\nlate: {late['counters']}")
    assert out["early_mixed_steps"] > 0 and greedy["early_mixed_steps"] > 0, (out, greedy)
    assert out["device_output_steps"] == out["early_draft_steps"], out
    assert out["stale_placeholders"] == greedy["stale_placeholders"] == 0, (out, greedy)
    assert late["early_draft_steps"] == 0, late
    assert greedy["counters"] == late["counters"], (greedy["counters"], late["counters"])
    assert len(greedy["verified_trees"]) >= greedy["counters"]["num_drafts"], len(greedy["verified_trees"])
    assert greedy["verified_trees"] == late["verified_trees"]
    assert greedy["counters"]["mean_acceptance_length"] > 1.5, greedy["counters"]


def _short(requests_, reference):
    """The requests that stay clear of max_model_len, and their reference outputs: near it the batch does not fit
    vLLM's drafter check, vLLM skips drafting for that step, and the placeholders it scheduled before go stale."""
    return requests_[:LONG], {"outputs": reference["outputs"][:LONG]}


def _assert_async(out):
    assert out["scheduling"] == {"async_scheduling": True, "batch_queue": True,
                                 "scheduler": "BoleAsyncScheduler"}, out["scheduling"]


def test_mtp_drafter_async_is_lossless_and_accepts_as_sync(tmp, model, requests_, reference):
    # 36 nodes over at most 6 requests: every request's quota is its 6 nodes (depth 3, topk 2) in both modes.
    requests_, reference = _short(requests_, reference)
    engine = full_vocab(bole_engine(tmp, "mtp", depth=3, topk=2, budget=36, drafter="mtp", max_num_seqs=6))
    sync = _run(tmp, model, requests_, "mtp_sync", engine, False)
    out = _run(tmp, model, requests_, "mtp_async", engine, True)
    _assert_async(out)
    divs = assert_lossless(reference, out, max_near_ties=2)
    assert_lossless(reference, sync, max_near_ties=2)
    a, s = out["counters"], sync["counters"]
    print(f"async: near ties {len(divs)}; counters {a}; queued {out['queued_trees']}, stale "
          f"{out['stale_placeholders']}, early {out['early_draft_steps']}\nsync: counters {s}")
    assert out["stale_placeholders"] == 0, out["stale_placeholders"]
    assert out["queued_trees"] > 0 and out["early_draft_steps"] > 0, out
    assert out["device_output_steps"] == 0, out   # logprobs asked for: the walk's paths go to the host
    assert_graphs_used(out, drafter=True)
    # The drafter reads the true prefixes: acceptance as in the synchronous engine (the batches' make-up
    # over time may differ a little).
    assert a["mean_acceptance_length"] >= 0.9 * s["mean_acceptance_length"], (a, s)
    assert a["mean_acceptance_length"] > 1.5, a


def test_planted_trees_async_are_lossless_and_deep(tmp, model, requests_, reference):
    """A host drafter (every step walked on the host) reads each request's context: under async scheduling vLLM's
    host copy ends in placeholders, which the runner fills with the emitted tokens, so the planted truth is
    found and accepted to full depth, under non-first siblings too."""
    requests_, reference = _short(requests_, reference)
    depth, topk = 4, 3
    engine = bole_engine(tmp, "planted_async", depth=depth, topk=topk, budget=512, max_num_seqs=6)
    out = _run(tmp, model, requests_, "planted_async", engine, True)
    _assert_async(out)
    assert_lossless(reference, out, max_near_ties=2)
    # The placeholder rows' positions: 1e-4 here; the depth-4 trees' rows left at the token index moved it to 9e-4
    # only, under the tolerance (the depth-8 planted tests of test_e2e_lossless.py catch that, at 2e-2).
    print(f"planted_async: largest logprob gap {assert_same_logprobs(reference, out):.2e}")
    assert out["stale_placeholders"] == 0, out["stale_placeholders"]
    per_pos = out["counters"]["accepted_per_pos"]
    assert per_pos[depth - 1] > 0, f"no request accepted a full depth-{depth} path: {per_pos}"
    stats = [json.loads(line) for line in (tmp / "planted_async.stats.jsonl").read_text().splitlines()]
    # Without the filled context the drafter would find no truth and plant nothing.
    planted = [d for d in stats if d["depth"] > 0]
    assert len(planted) > len(stats) // 2, f"{len(planted)} of {len(stats)} trees planted the truth"
    assert any(any(s > 0 for s in d["siblings"]) for d in planted), "truth never under a non-first sibling"


def test_requests_stop_inside_accepted_paths_async(tmp, model, requests_, reference):
    """Each request stops at a token of its reference continuation while the next step, with its placeholders,
    is already scheduled: vLLM cuts the output at the stop token inside an accepted path and discards the step in
    flight; the other requests go on with their trees."""
    reqs, expected = [], []
    for i, (r, out) in enumerate(zip(requests_[:LONG], reference["outputs"])):
        stop = out["tokens"][5 + 3 * i]
        reqs.append(dict(r, stop_token_ids=[stop]))
        expected.append(out["tokens"][:out["tokens"].index(stop) + 1])
    engine = bole_engine(tmp, "mtp_stop", depth=3, topk=2, budget=36, drafter="mtp", max_num_seqs=6)
    out = _run(tmp, model, reqs, "mtp_stop", engine, True)
    _assert_async(out)
    assert [o["tokens"] for o in out["outputs"]] == expected
    assert all(o["finish_reason"] == "stop" for o in out["outputs"])
    assert out["counters"]["num_accepted_tokens"] > 0 and out["early_draft_steps"] > 0, out


def test_a_budget_below_the_batch_drafts_nothing_async(tmp, model, requests_, reference):
    """A budget of fewer nodes than decoding requests gives each a quota of 0: no placeholders, plain decode
    steps (the tokens of vLLM's own sampler, on the device), outputs still exact."""
    requests_, reference = _short(requests_, reference)
    engine = bole_engine(tmp, "mtp_k0", depth=3, topk=2, budget=4, drafter="mtp", max_num_seqs=6)
    out = _run(tmp, model, requests_, "mtp_k0", engine, True)
    _assert_async(out)
    assert [o["tokens"] for o in out["outputs"]] == [o["tokens"] for o in reference["outputs"]]
    assert out["counters"]["num_draft_tokens"] == 0 and out["stale_placeholders"] == 0, out


@pytest.mark.parametrize("depth,topk,budget", [(3, 2, 12), (8, 4, 24)])
def test_quotas_growing_as_the_batch_drains_async(tmp, model, requests_, reference, depth, topk, budget):
    """A budget the batch shares, requests of different lengths: as they finish, each remaining one's quota grows
    (budget 12: 2 nodes each for 6 requests, 3 or 2 for 5, 3 for 4, 6 for 2; budget 24 at depth 8: up to 24 nodes,
    more than the depth) while the trees drafted at the smaller quota are in flight."""
    lengths = [8 + 4 * i for i in range(LONG)]
    reqs = [dict(r, max_tokens=n) for r, n in zip(requests_[:LONG], lengths)]
    name = f"mtp_grow_{depth}_{topk}"
    engine = bole_engine(tmp, name, depth=depth, topk=topk, budget=budget, drafter="mtp", max_num_seqs=6)
    out = _run(tmp, model, reqs, name, engine, True)
    _assert_async(out)
    assert [o["tokens"] for o in out["outputs"]] == [o["tokens"][:n] for o, n in zip(reference["outputs"], lengths)]
    assert out["stale_placeholders"] == 0, out["stale_placeholders"]
    assert out["queued_trees"] > 0 and out["early_draft_steps"] > 0, out
    # Every step drafts the whole budget (up to each request's cap): with 5 requests and 12 nodes, 2 requests of 3
    # and 3 of 2, not 5 of 2.
    assert out["budgets"] and all(n == min(budget, b * depth * topk) for b, n, _ in out["budgets"]), out["budgets"]
    assert_graphs_used(out, drafter=True)


def test_drafting_after_the_walk_when_drafting_before_it_fails_async(tmp, model, requests_, reference):
    """A failure of the drafting before the walk (planted in its third step) under async scheduling: that step
    and the later ones draft after the walk, still exactly the scheduler's quotas (no stale placeholders), and the
    outputs stay exact."""
    requests_, reference = _short(requests_, reference)
    engine = bole_engine(tmp, "mtp_fail_async", depth=3, topk=4, budget=24, drafter="mtp", max_num_seqs=8)
    engine["speculative_config"] |= {"drafter": "vllm_bole.testing.faulty_drafter:FailOnceBeforeWalk",
                                     "drafter_args": {"fail_at": 3}}
    out = _run(tmp, model, requests_, "mtp_fail_async", engine, True)
    _assert_async(out)
    assert [o["tokens"] for o in out["outputs"]] == [o["tokens"] for o in reference["outputs"]]
    assert out["early_draft_steps"] == 3 and out["first_pass_steps"] > 3, out
    assert out["stale_placeholders"] == 0, out["stale_placeholders"]
    assert out["counters"]["mean_acceptance_length"] > 1.5, out["counters"]


def test_logprobs_and_a_request_at_max_model_len_async(tmp, model, requests_, reference):
    """Logprobs asked for (the walk's tokens go through the host), a sampled request (vLLM repairs the host copies
    of the outputs behind their placeholders) and a request that runs into max_model_len: the engine must not count
    placeholders past max_model_len, and the greedy outputs stay exact. The sampled request has no seed: a step
    with a seeded request walks on the host, and this one must draft early."""
    reqs = [dict(r) for r in requests_] + [{"prompt": requests_[2]["prompt"], "max_tokens": 20,
                                            "temperature": 0.8}]
    engine = bole_engine(tmp, "mtp_logprobs_long", depth=3, topk=4, budget="auto", drafter="mtp", max_num_seqs=16)
    out = _run(tmp, model, reqs, "mtp_logprobs_long", engine, True)
    _assert_async(out)
    sampled = out["outputs"].pop()
    assert len(sampled["tokens"]) == 20
    assert_lossless(reference, out, max_near_ties=2)
    assert out["outputs"][LONG]["finish_reason"] == "length", out["outputs"][LONG]
    assert out["early_draft_steps"] > 0, out
