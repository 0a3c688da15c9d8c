"""Structured outputs with Bole equal vLLM's without speculation (CPU, tiny Qwen3.5, greedy; regex, JSON schema
and choice grammars).

A structured-output request walks its tree: the scheduler's grammar bitmask has one row per tree node
(``worker/tree_grammar.py``), under synchronous and async scheduling.
"""

import pytest

from e2e_support import (assert_lossless, bole_engine, random_requests, run_engine, sync_and_async_runs, vocab_size,
                          write_oracle)

pytestmark = pytest.mark.vllm


def test_structured_outputs_are_lossless_sync_and_async(tmp_path, tiny_qwen3_5_dir):
    model = tiny_qwen3_5_dir
    requests = random_requests(vocab_size(model), [5, 12, 30, 7, 9], 40, seed=3)
    for r in requests[:3]:
        r |= {"structured": {"regex": "[a-z ]{8,80}"}, "ignore_eos": False}
    ref = run_engine(tmp_path, "ref", {"model": model, "requests": requests, "logprobs": 2,
                                       "engine": {"max_num_seqs": 8}})
    assert all(o["finish_reason"] == "stop" for o in ref["outputs"][:3]), ref["outputs"]
    write_oracle(tmp_path, requests, ref)
    for name, spec in sync_and_async_runs(tmp_path).items():
        out = run_engine(tmp_path, name, {"model": model, "requests": requests, "logprobs": 2, **spec})
        assert_lossless(ref, out, max_near_ties=2)
        assert [o["finish_reason"] for o in out["outputs"]] == [o["finish_reason"] for o in ref["outputs"]]
        print(f"{name}: counters {out['counters']}, scheduling {out['scheduling']}")
        assert out["counters"]["num_accepted_tokens"] > 0, out["counters"]
    assert out["scheduling"]["scheduler"] == "BoleAsyncScheduler" and out["scheduling"]["batch_queue"]


GRAMMARS = [
    {"regex": "[a-z ]{8,80}"},
    {"regex": "(ab|cd)+ [0-9]{2,6}"},
    {"json": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 6}},
              "required": ["a", "b"]}},
    {"choice": ["alpha beta gamma", "delta epsilon", "alpha beta delta"]},
]


def _matches(grammar: dict, text: str) -> bool:
    import json
    import re

    if "regex" in grammar:
        return re.fullmatch(grammar["regex"], text) is not None
    if "choice" in grammar:
        return text in grammar["choice"]
    value = json.loads(text)
    return isinstance(value.get("a"), int) and isinstance(value.get("b"), str) and len(value["b"]) <= 6


def test_structured_output_trees_are_walked(tmp_path, tiny_qwen3_5_dir):
    """Structured-output requests walk their trees, with one grammar bitmask row per tree node (the grammar
    advanced along the node's path). Planted trees (the true continuation at a random depth and sibling, among
    random tokens the grammar mostly forbids) accept deep and the outputs equal vLLM's without speculation, under
    synchronous and async scheduling; sampled requests with MTP trees finish inside their grammars."""
    from transformers import AutoTokenizer

    model = tiny_qwen3_5_dir
    requests = random_requests(vocab_size(model), [5, 12, 30, 7, 9, 6, 14, 8], 40, seed=4)
    for i, r in enumerate(requests):
        r |= {"structured": GRAMMARS[i % len(GRAMMARS)], "ignore_eos": False}
    ref = run_engine(tmp_path, "ref", {"model": model, "requests": requests, "logprobs": 2,
                                       "engine": {"max_num_seqs": 8}})
    assert sum(o["finish_reason"] == "stop" for o in ref["outputs"]) >= 4, ref["outputs"]
    write_oracle(tmp_path, requests, ref)
    runs = {"planted_sync": sync_and_async_runs(tmp_path)["planted_sync"],
            # async: vLLM defers the step's sampling until the previous step's tokens reached the grammars, then asks
            # the runner for the trees behind the placeholders
            "planted_async": {"engine": bole_engine(tmp_path, "planted_async", depth=4, topk=3, budget=512,
                                                    max_num_seqs=8, async_scheduling=True),
                              "cpu_async_scheduling": True}}
    for name, spec in runs.items():
        out = run_engine(tmp_path, name, {"model": model, "requests": requests, "logprobs": 2, **spec})
        assert_lossless(ref, out, max_near_ties=2)
        assert [o["finish_reason"] for o in out["outputs"]] == [o["finish_reason"] for o in ref["outputs"]]
        print(f"{name}: counters {out['counters']}, scheduling {out['scheduling']}")
        # Root-only verification would give exactly 1 token per step; the planted depth is uniform in 0..4.
        assert out["counters"]["mean_acceptance_length"] > 2.2, out["counters"]
        assert out["counters"]["accepted_per_pos"][3] > 0, out["counters"]
    assert out["scheduling"]["scheduler"] == "BoleAsyncScheduler" and out["scheduling"]["batch_queue"]

    tok = AutoTokenizer.from_pretrained(model)
    sampled = [dict(r, temperature=0.8, seed=i) for i, r in enumerate(requests)]
    for asynchronous in (False, True):
        name = f"mtp_sampled_{'async' if asynchronous else 'sync'}"
        engine = bole_engine(tmp_path, name, depth=3, topk=2, budget=48, drafter="mtp", max_num_seqs=8,
                             async_scheduling=asynchronous)
        out = run_engine(tmp_path, name, {"model": model, "requests": sampled, "engine": engine,
                                          "cpu_async_scheduling": asynchronous})
        print(f"{name}: counters {out['counters']}")
        assert out["counters"]["num_accepted_tokens"] > 0, out["counters"]
        for r, o in zip(sampled, out["outputs"]):
            text = tok.decode(o["tokens"], skip_special_tokens=True)
            assert o["finish_reason"] != "stop" or _matches(r["structured"], text), (r["structured"], text)
        assert sum(o["finish_reason"] == "stop" for o in out["outputs"]) >= 4, out["outputs"]
