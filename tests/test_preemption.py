"""Preemption with Bole equals vLLM without speculation (CPU, tiny Qwen3.5, greedy).

A KV cache of 20 blocks (128 tokens each; under Bole's KV-cache groups a block holds one layer's page, and a
request takes a block per GDN layer plus one per 128 tokens for each of the two attention layers, the target's and
the MTP layer's) holds about three of these requests, so vLLM preempts running requests as they grow and later
recomputes them from their tokens; their trees, queued drafts and placeholders must not outlive the preemption.
"""

import pytest

from e2e_support import (assert_lossless, random_requests, run_engine, sync_and_async_runs, vocab_size,
                          write_oracle)

pytestmark = pytest.mark.vllm

CACHE = {"num_gpu_blocks_override": 20, "max_num_seqs": 8}


def test_preempted_requests_are_lossless(tmp_path, tiny_qwen3_5_dir):
    model = tiny_qwen3_5_dir
    requests = random_requests(vocab_size(model), [30, 60, 20, 90, 45, 10, 70, 25], 120, seed=3)
    ref = run_engine(tmp_path, "ref", {"model": model, "requests": requests, "logprobs": 2, "engine": CACHE})
    write_oracle(tmp_path, requests, ref)
    for name, spec in sync_and_async_runs(tmp_path).items():
        spec["engine"] |= CACHE
        out = run_engine(tmp_path, name, {"model": model, "requests": requests, "logprobs": 2, **spec})
        print(f"{name}: preemptions {out['preemptions']}, counters {out['counters']}")
        assert out["preemptions"] > 0
        assert_lossless(ref, out, max_near_ties=2)
        assert out["counters"]["num_accepted_tokens"] > 0, out["counters"]
        assert max(i for i, n in enumerate(out["counters"]["accepted_per_pos"]) if n) >= 2, out["counters"]
