"""Structured outputs with Bole equal vLLM's without speculation (CPU, tiny Qwen3.5, greedy, a regex grammar).

A structured-output request's next token comes from vLLM's sampler with its grammar, so it carries no drafts
(under synchronous and async scheduling); the other requests of the batch keep their trees.
"""

import pytest

from e2e_support import (assert_lossless, random_requests, run_engine, sync_and_async_runs, vocab_size,
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
