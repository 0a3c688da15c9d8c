"""Seeded sampled requests through Bole (CPU, tiny Qwen3.5 with a soft output head).

A seeded request's tree rows draw one noise vector per depth from its generator, and after the walk the generator
goes back to just after the vectors its emitted tokens used (``tree_sampler.SeededDraws``). The token at each output
position then reads the same noise as without speculation, so a seeded request's output is vLLM's own output for
that seed, whatever the trees held, whatever the batch around it (the per-request node quota follows the batch
size) and however its prompt was chunked. vLLM's CPU runner crashed on a seeded prompt prefilled in chunks (it
rewinds a discarded draw by a Philox offset, which CPU generators lack); Bole restores the generator's state
instead (``_vllm_compat.discarded_cpu_draws_undone``).

vLLM's CPU sampler honours per-request seeds only in a batch whose requests all have one (otherwise it samples
every row from the default generator), so the batches here are all seeded; vLLM itself gives a seeded request the
same output alone and beside other seeded requests (checked below), and so must Bole.
"""

import random

import pytest

from e2e_support import bole_engine, run_engine, write_oracle

pytestmark = pytest.mark.vllm

MAX_TOKENS = 16
SOFT_LOGIT_SCALE = 8.0   # spreads the tiny model's next-token distribution (see test_e2e_sampling.py)
SETTINGS = [dict(temperature=1.0), dict(temperature=1.2, top_k=12), dict(temperature=0.9, top_p=0.9),
            dict(temperature=1.5, min_p=0.05)]


def _requests(n: int, seed: int, first_seed: int) -> list[dict]:
    """Seeded sampled requests with prompts of 20 to 200 tokens (longer than the chunks below)."""
    rng = random.Random(seed)
    return [{"prompt": [rng.randrange(10, 1000) for _ in range(rng.randrange(20, 200))], "max_tokens": MAX_TOKENS,
             "seed": first_seed + i, **SETTINGS[i % len(SETTINGS)]} for i in range(n)]


MINE = _requests(6, seed=7, first_seed=100)        # the requests whose outputs are compared
NEIGHBOURS = _requests(6, seed=8, first_seed=500)  # other seeded requests in the same batch


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e_seeds")


@pytest.fixture(scope="module")
def model(tmp):
    from vllm_bole.testing.tiny_models import build_tiny_qwen3_5

    return str(build_tiny_qwen3_5(tmp / "soft-model", logit_scale=SOFT_LOGIT_SCALE))


def _tokens(out: dict) -> list[list[int]]:
    tokens = [o["tokens"] for o in out["outputs"]]
    assert all(len(t) == MAX_TOKENS for t in tokens)
    return tokens


@pytest.fixture(scope="module")
def reference(tmp, model) -> list[list[int]]:
    """vLLM without speculation, prompts in one chunk: the requests alone, and beside their neighbours (whose
    outputs become the planted drafter's oracle, so the trees hold the sampled continuations)."""
    engine = {"max_num_seqs": 12, "max_num_batched_tokens": 2048}
    alone = _tokens(run_engine(tmp, "seeded_ref", {"model": model, "engine": engine, "requests": MINE}))
    both = run_engine(tmp, "seeded_ref_neighbours", {"model": model, "engine": engine,
                                                     "requests": MINE + NEIGHBOURS})
    assert _tokens(both)[:len(MINE)] == alone, "vLLM's seeded outputs moved with their batch"
    assert len({tuple(t) for t in alone}) == len(alone)
    write_oracle(tmp, MINE + NEIGHBOURS, both)
    return alone


def _differing(ref: list[list[int]], got: list[list[int]]) -> list[tuple[int, int]]:
    """(request, first differing position) of every output that differs from its reference."""
    return [(i, next(j for j, (x, y) in enumerate(zip(a, b)) if x != y))
            for i, (a, b) in enumerate(zip(ref, got)) if a != b]


# "planted_chunked": the requests alone, prompts prefilled in chunks of 64 tokens (vLLM's CPU runner crashed here);
# "planted_neighbours": beside six other seeded requests, so every tree gets a smaller share of the budget;
# "mtp_async": the MTP drafter under vLLM's async scheduling (run on CPU), beside the neighbours, chunked.
CASES = {
    "planted_chunked": dict(requests=MINE, drafter="planted", engine={"max_num_batched_tokens": 64}),
    "planted_neighbours": dict(requests=MINE + NEIGHBOURS, drafter="planted", engine={}),
    "mtp_async": dict(requests=MINE + NEIGHBOURS, drafter="mtp",
                      engine={"max_num_batched_tokens": 64, "async_scheduling": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_seeded_outputs_equal_vllm_without_speculation(tmp, model, reference, case):
    c = CASES[case]
    engine = bole_engine(tmp, case, depth=4, topk=3, budget=96, drafter=c["drafter"], max_num_seqs=12,
                         **c["engine"])
    spec = {"model": model, "engine": engine, "requests": c["requests"]}
    if c["engine"].get("async_scheduling"):
        spec["cpu_async_scheduling"] = True
    out = run_engine(tmp, case, spec)
    got, counters = _tokens(out)[:len(MINE)], out["counters"]
    print(f"{case}: counters {counters}; scheduling {out['scheduling']}")
    assert out["scheduling"]["async_scheduling"] == bool(c["engine"].get("async_scheduling"))
    # Sampled tokens drawn from bf16 tree rows may flip where two tokens' noisy scores nearly tie: one at most.
    diffs = _differing(reference, got)
    assert len(diffs) <= 1, diffs
    # The trees were walked deep: accepted drafts at depth 3 (planted: the sampled continuation is in them).
    assert counters["num_accepted_tokens"] > 0 and counters["accepted_per_pos"][1] > 0, counters
    if c["drafter"] == "planted":
        assert counters["accepted_per_pos"][3] > 0, counters
