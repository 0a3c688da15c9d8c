"""Bole on the tiny MoE models (Qwen3.5-MoE and Qwen3-Next: routed experts + a shared expert, GDN + attention, one
MTP layer): lossless greedy."""

import pytest

from e2e_support import (assert_lossless, bole_engine, full_vocab, random_requests, run_engine, run_engines,
                          skip_without_moe_kernels, vocab_size, write_oracle)

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_next"])
def test_moe_planted_and_mtp_trees_are_lossless(tmp_path, kind):
    from vllm_bole.testing.tiny_models import tiny_model_dir

    skip_without_moe_kernels()
    model = tiny_model_dir(kind)
    reqs = random_requests(vocab_size(model), [4, 9, 17, 33, 60, 6], max_tokens=32, seed=7)
    base = {"model": model, "kind": kind, "requests": reqs, "logprobs": 2}
    ref = run_engine(tmp_path, "ref", base | {"engine": {"max_num_seqs": 8}})
    write_oracle(tmp_path, reqs, ref)
    runs = run_engines(tmp_path, {
        "planted": base | {"engine": bole_engine(tmp_path, "planted", 5, 3, 256, max_num_seqs=8)},
        "mtp": base | {"engine": full_vocab(bole_engine(tmp_path, "mtp", 3, 2, "auto", drafter="mtp",
                                                        max_num_seqs=8))}})
    planted, mtp = runs["planted"], runs["mtp"]
    assert_lossless(ref, planted, max_near_ties=1)
    assert planted["counters"]["accepted_per_pos"][4] > 0
    assert all(g["num_speculative_blocks"] == 0 for g in planted["mamba_state"])
    assert_lossless(ref, mtp, max_near_ties=1)
    print(kind, "mtp counters", mtp["counters"])
    assert mtp["counters"]["mean_acceptance_length"] > 1.5
