"""Request features end to end through Bole (CPU, tiny Qwen3.5): ``n`` > 1 and prompt logprobs.

``n=2``: vLLM runs each choice as a child request, and each child walks its own tree; the choices' tokens, and the
pair of the two choices' first tokens (their independence), follow vLLM's distribution without speculation
(chi-square, as in test_e2e_sampling.py). Prompt logprobs: requests that ask for them carry no drafts (their rows
are vLLM's own prefill), their neighbours still walk trees, and every output and prompt logprob equals vLLM's.
"""

import random

import pytest

from e2e_support import (LOGPROB_TOL, bole_engine, chi_square_two_sample, random_requests, run_engine, vocab_size,
                         write_oracle)

pytestmark = pytest.mark.vllm

P_MIN = 1e-3


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e_requests")


# ---- n > 1 ----------------------------------------------------------------------------------------------------
NUM_REQUESTS, MAX_TOKENS = 400, 3


@pytest.fixture(scope="module")
def soft_model(tmp):
    from vllm_bole.testing.tiny_models import build_tiny_qwen3_5

    return str(build_tiny_qwen3_5(tmp / "soft-model", logit_scale=8.0))   # a spread next-token distribution


def _two_choice_requests() -> list[dict]:
    prompt = [random.Random(5).randrange(10, 1000) for _ in range(9)]
    return [{"prompt": prompt, "max_tokens": MAX_TOKENS, "n": 2, "temperature": 2.0, "top_k": 6}
            for _ in range(NUM_REQUESTS)]


def _choices(out: dict) -> list[list[list[int]]]:
    choices = [o["choices"] for o in out["outputs"]]
    assert all(len(c) == 2 and all(len(t) == MAX_TOKENS for t in c) for c in choices)
    return choices


def test_two_choices_match_reference_distribution(tmp, soft_model):
    ref = _choices(run_engine(tmp, "n2_ref", {"model": soft_model, "engine": {"max_num_seqs": 64},
                                              "requests": _two_choice_requests()}))
    engine = bole_engine(tmp, "n2_mtp", depth=2, topk=3, budget=512, drafter="mtp", max_num_seqs=64)
    out = run_engine(tmp, "n2_mtp", {"model": soft_model, "engine": engine, "requests": _two_choice_requests()})
    got, counters = _choices(out), out["counters"]
    print(f"n=2: counters {counters}")
    assert counters["accepted_per_pos"][1] > 0, counters   # trees walked below their roots
    samples = {"t2": lambda c: [t[1] for t in c], "t3": lambda c: [t[2] for t in c],
               "(t1,t2)": lambda c: [(t[0], t[1]) for t in c],
               "(choice 1 t1, choice 2 t1)": lambda c: [(c[0][0], c[1][0])]}
    for label, key in samples.items():
        stat, p, dof = chi_square_two_sample([x for c in ref for x in key(c)], [x for c in got for x in key(c)])
        print(f"n=2 {label}: chi2 {stat:.1f}, dof {dof}, p {p:.3g}")
        assert p > P_MIN, (label, stat, dof, p)


# ---- prompt logprobs -------------------------------------------------------------------------------------------
def test_prompt_logprobs_equal_vllm_without_speculation(tmp, tiny_qwen3_5_dir):
    requests = random_requests(vocab_size(tiny_qwen3_5_dir), [9, 40, 17, 60, 25], max_tokens=12, seed=31)
    for i in (0, 3):
        requests[i]["prompt_logprobs"] = 2
    ref = run_engine(tmp, "prompt_logprobs_ref", {"model": tiny_qwen3_5_dir, "requests": requests})
    write_oracle(tmp, requests, ref)
    engine = bole_engine(tmp, "prompt_logprobs", depth=4, topk=3, budget=64, max_num_seqs=8)
    out = run_engine(tmp, "prompt_logprobs", {"model": tiny_qwen3_5_dir, "engine": engine, "requests": requests})
    counters = out["counters"]
    print(f"prompt logprobs: counters {counters}")
    assert counters["accepted_per_pos"][3] > 0, counters   # the other requests' trees are walked deep
    assert [o["tokens"] for o in out["outputs"]] == [o["tokens"] for o in ref["outputs"]]
    for i, (a, b) in enumerate(zip(ref["outputs"], out["outputs"])):
        if i not in (0, 3):
            assert not b["prompt_logprobs"]
            continue
        assert len(b["prompt_logprobs"]) == len(requests[i]["prompt"]) - 1
        for pos, (la, lb) in enumerate(zip(a["prompt_logprobs"], b["prompt_logprobs"])):
            token = str(requests[i]["prompt"][pos + 1])   # the prompt's own token is always among them
            # The batch's other rows change the matmuls' rounding: one bf16 step of a logit of that size
            # (random prompt tokens sit at logprobs down to -20, where a step is 0.0625 to 0.125).
            assert abs(la[token] - lb[token]) <= LOGPROB_TOL + abs(la[token]) * 2 ** -7, (i, pos, la, lb)
