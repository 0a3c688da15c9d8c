"""Aborted requests with trees (CPU, tiny Qwen3.5): a request aborted after k = 0..5 engine steps (before its
prefill, with its tree drafted, under async scheduling while its next step and drafts are queued) leaves every other
request's greedy output equal to vLLM's without speculation, and nothing behind: requests that reuse its slots
afterwards are unaffected, and neither the scheduler, nor the model runner, nor Bole's per-request state holds any
of the earlier requests at the end."""

import pytest

from e2e_support import (assert_same_logprobs, bole_engine, random_requests, run_engine, vocab_size,
                          write_oracle)

pytestmark = pytest.mark.vllm

AFTER_STEPS = [0, 1, 2, 3, 4, 5]
ABORT = [1, 3]   # a greedy and a sampled request


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e_aborts")


@pytest.fixture(scope="module")
def requests(tiny_qwen3_5_dir):
    reqs = random_requests(vocab_size(tiny_qwen3_5_dir), [7, 30, 12, 45, 21], max_tokens=14, seed=21)
    reqs[3] |= {"temperature": 0.8}
    return reqs


@pytest.fixture(scope="module")
def after(tiny_qwen3_5_dir):
    return random_requests(vocab_size(tiny_qwen3_5_dir), [33, 9, 18], max_tokens=14, seed=22)


@pytest.fixture(scope="module")
def reference(tmp, tiny_qwen3_5_dir, requests, after):
    ref = run_engine(tmp, "ref", {"model": tiny_qwen3_5_dir, "requests": requests + after, "logprobs": 1})
    write_oracle(tmp, requests + after, ref)
    return ref["outputs"]


@pytest.mark.parametrize("mode", ["planted_sync", "mtp_async"])
def test_aborts_leave_other_requests_and_no_state(tmp, tiny_qwen3_5_dir, requests, after, reference, mode):
    if mode == "planted_sync":
        engine = bole_engine(tmp, mode, depth=4, topk=3, budget=64, max_num_seqs=8)
    else:
        engine = bole_engine(tmp, mode, depth=3, topk=2, budget=48, drafter="mtp", max_num_seqs=8,
                             async_scheduling=True)
    out = run_engine(tmp, mode, {"model": tiny_qwen3_5_dir, "engine": engine, "requests": requests,
                                 "abort": ABORT, "after_steps": AFTER_STEPS, "after": after, "logprobs": 1,
                                 "cpu_async_scheduling": mode == "mtp_async"}, runner="abort_run")
    assert out["scheduling"]["async_scheduling"] == (mode == "mtp_async")
    kept = [i for i in range(len(requests)) if i not in ABORT]
    for rnd in out["rounds"]:
        want = {"outputs": [reference[i] for i in kept]}
        assert [o["tokens"] for o in rnd["outputs"]] == [o["tokens"] for o in want["outputs"]], rnd["after_steps"]
        assert all(o["finish_reason"] == "length" for o in rnd["outputs"])
        # (greedy tokens on the tiny model hardly depend on attention: a row at a wrong position shows here)
        assert_same_logprobs(want, rnd)
    want = {"outputs": reference[len(requests):]}
    assert [o["tokens"] for o in out["after"]] == [o["tokens"] for o in want["outputs"]]
    assert_same_logprobs(want, {"outputs": out["after"]})
    held = out["held"]
    print(f"{mode}: held {held}; queued trees {out['queued_trees']}")
    assert held["kv_cache_usage"] == 0.0 and not held["scheduler_requests"], held
    # The model runner learns of finished requests with the next step, and Bole's trees and queued drafts are
    # replaced by each drafting step: what the last step held may remain, nothing from the rounds before it.
    for key in ("runner_requests", "batch_requests", "draft_trees", "host_emitted", "queued_drafts"):
        assert not [r for r in held[key] or () if r.startswith("round")], (key, held)
    if mode == "mtp_async":
        assert out["queued_trees"] > 0
