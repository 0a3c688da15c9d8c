"""Sampled requests (temperature > 0 with top-k / top-p / min-p) through Bole's tree walk have the same output
distribution as vLLM without speculation (CPU, tiny Qwen3.5).

Hundreds of short continuations of one prompt (different seeds, some unseeded) run without speculation, with the
planted drafter (trees that hold the greedy continuation) and with the MTP drafter; the 2nd and 3rd tokens and the
(1st, 2nd) pair are compared with a chi-square two-sample test. The temperature is high enough that several tokens
have real probability, and the spec-decode counters must show accepted drafts, so the trees are actually walked.
Requests with penalties get a test of their own: a tree row's penalties count the tokens on the row's path.
"""

import json
import random
from collections import Counter

import pytest

from e2e_support import bole_engine, chi_square_two_sample, run_engine, write_oracle

pytestmark = pytest.mark.vllm

NUM_REQUESTS = 800
MAX_TOKENS = 3
P_MIN = 1e-3
# Three sampling settings, alternating; every fourth request has no seed (default generator). min-p, which vLLM
# rejects with its own speculative methods, shapes Bole's tree rows.
SETTINGS = [dict(temperature=2.0, top_k=6), dict(temperature=1.5, top_k=10, top_p=0.8),
            dict(temperature=2.0, min_p=0.15)]
# The default tiny model's logits are sharp (the top token leads by 7-10 nats); a softer lm_head spreads the
# next-token distribution within vLLM's temperature range.
SOFT_LOGIT_SCALE = 8.0


def _sampled_requests(prompt: list[int], seeds: bool = True) -> list[dict]:
    """``seeds=False``: none seeded (a step with a seeded request walks on the host, not on the early path)."""
    reqs = []
    for i in range(NUM_REQUESTS):
        req = {"prompt": prompt, "max_tokens": MAX_TOKENS, **SETTINGS[i % len(SETTINGS)]}
        if i % 4 and seeds:
            req["seed"] = 1000 + i
        reqs.append(req)
    return reqs


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e_sampling")


@pytest.fixture(scope="module")
def model(tmp):
    from vllm_bole.testing.tiny_models import build_tiny_qwen3_5

    return str(build_tiny_qwen3_5(tmp / "soft-model", logit_scale=SOFT_LOGIT_SCALE))


@pytest.fixture(scope="module")
def prompt():
    rng = random.Random(99)
    return [rng.randrange(10, 1000) for _ in range(9)]


@pytest.fixture(scope="module")
def reference(tmp, model, prompt):
    """Sampled continuations without speculation, plus the greedy one (the planted drafter's oracle)."""
    greedy = {"prompt": prompt, "max_tokens": MAX_TOKENS + 1}
    ref = run_engine(tmp, "sampled_ref", {"model": model, "engine": {"max_num_seqs": 64},
                                          "requests": _sampled_requests(prompt) + [greedy]})
    write_oracle(tmp, [greedy], {"outputs": [ref["outputs"].pop()]})
    return ref


def _tokens(out: dict) -> list[list[int]]:
    tokens = [o["tokens"] for o in out["outputs"]]
    assert all(len(t) == MAX_TOKENS for t in tokens)
    return tokens


def test_reference_is_spread(reference):
    """The test has power only if several tokens are likely at each position."""
    for pos in range(MAX_TOKENS):
        counts = Counter(t[pos] for t in _tokens(reference))
        top = counts.most_common(1)[0][1] / NUM_REQUESTS
        likely = sum(1 for c in counts.values() if c >= 0.03 * NUM_REQUESTS)
        print(f"position {pos}: top share {top:.2f}, tokens over 3%: {likely}, distinct {len(counts)}")
        assert top < 0.75 and likely >= 3, counts.most_common(8)


# selection None runs the default, per_request: 8 nodes per request (512 over 64), the trees reach the step as
# placeholders.
# "early": the MTP drafter with the drafting queued before the walk (early_drafting, the default), whose device
# walk matches each row's draw (its requests unseeded: a seeded request's steps walk on the host); the other MTP case
# turns it off.
@pytest.mark.parametrize("drafter,selection", [("planted", "global"), ("mtp", "global"), ("planted", None),
                                               ("mtp", "early")])
def test_sampled_outputs_match_reference_distribution(tmp, model, prompt, reference, drafter, selection):
    early = selection == "early"
    selection = None if early else selection
    name = f"sampled_{drafter}" + (f"_{selection}" if selection else "") + ("_early" if early else "")
    engine = bole_engine(tmp, name, depth=2, topk=3, budget=512, drafter=drafter, selection=selection,
                         max_num_seqs=64)
    engine["speculative_config"]["early_drafting"] = early
    out = run_engine(tmp, name, {"model": model, "engine": engine,
                                 "requests": _sampled_requests(prompt, seeds=not early)})
    ref, got = _tokens(reference), _tokens(out)
    counters = out["counters"]
    print(f"{name}: counters {counters}; queued trees {out['queued_trees']}")
    assert (out["queued_trees"] > 0) == (selection != "global"), out["queued_trees"]   # per_request: the default
    assert (out["early_draft_steps"] > 0) == early, out["early_draft_steps"]
    assert counters["num_accepted_tokens"] > 0, counters
    assert counters["accepted_per_pos"][1] > 0, counters
    samples = {"t2": lambda t: t[1], "t3": lambda t: t[2], "(t1,t2)": lambda t: (t[0], t[1])}
    for label, key in samples.items():
        stat, p, dof = chi_square_two_sample([key(t) for t in ref], [key(t) for t in got])
        print(f"{name} {label}: chi2 {stat:.1f}, dof {dof}, p {p:.3g}")
        assert p > P_MIN, (label, stat, dof, p)


# Sampled requests with penalties: each tree row is drawn after vLLM's penalties with the row's path appended to the
# output, so a row's distribution depends on the tokens drafted above it. The 1st token comes from the prefill and
# the trees verify the 2nd and 3rd, so the 3rd is drawn from a depth-1 row whose path is the 2nd. Negative presence
# and frequency penalties make the 3rd token repeat the 2nd in about a tenth of the requests (the test's power: a row
# drawn without its path repeats far less often; the tiny model never repeats a token on its own); repetition and
# frequency penalties above 0 the opposite.
PENALTY_SETTINGS = [dict(temperature=1.0, top_k=8, presence_penalty=-2.0, frequency_penalty=-2.0),
                    dict(temperature=1.5, top_k=8, repetition_penalty=1.6, frequency_penalty=1.0)]


def _penalty_requests(prompt: list[int]) -> list[dict]:
    return [{"prompt": prompt, "max_tokens": MAX_TOKENS, "seed": 5000 + i, **PENALTY_SETTINGS[i % 2]}
            for i in range(NUM_REQUESTS)]


def _repeats(tokens: list[list[int]], setting: int) -> float:
    """Share of the setting's requests whose 3rd token repeats their 2nd."""
    mine = tokens[setting::len(PENALTY_SETTINGS)]
    return sum(t[2] == t[1] for t in mine) / len(mine)


@pytest.fixture(scope="module")
def penalty_reference(tmp, model, prompt, reference):
    ref = _tokens(run_engine(tmp, "penalty_ref", {"model": model, "engine": {"max_num_seqs": 64},
                                                  "requests": _penalty_requests(prompt)}))
    print(f"penalty reference: the 3rd token repeats the 2nd in {_repeats(ref, 0):.2f} / {_repeats(ref, 1):.2f}")
    assert _repeats(ref, 0) > 0.05 and _repeats(ref, 1) < 0.02   # the penalties shape the 3rd token
    return ref


@pytest.mark.parametrize("drafter", ["planted", "mtp"])
def test_sampled_penalty_requests_match_reference_distribution(tmp, model, prompt, penalty_reference, drafter):
    """Planted trees scheduled synchronously, MTP trees under async scheduling; the trees are walked below their
    roots (accepted drafts at depth 2) and the (setting, 2nd, 3rd) tokens, and whether the 3rd repeats the 2nd,
    follow vLLM's distribution without speculation. Power, checked by drawing the rows without their paths: the
    MTP run's repeat share drops (p ~ 2e-4) and the planted trees' hidden repeats are never accepted."""
    name = f"penalty_{drafter}"
    oracle_dir = tmp / "penalty_oracle"
    if drafter == "planted":   # trees that hide, after each 1st token, its likeliest 2nd and then a repeat of it
        oracle_dir.mkdir(exist_ok=True)
        seconds = {}
        for t in penalty_reference[0::len(PENALTY_SETTINGS)]:
            seconds.setdefault(t[0], Counter())[t[1]] += 1
        (oracle_dir / "oracle.json").write_text(json.dumps(
            [{"prompt": prompt, "output": [t1] + [c.most_common(1)[0][0]] * 2}
             for t1, c in seconds.items()]))
    engine = bole_engine(oracle_dir, name, depth=2, topk=3, budget=512, drafter=drafter, max_num_seqs=64,
                         async_scheduling=drafter == "mtp")
    spec = {"model": model, "engine": engine, "requests": _penalty_requests(prompt)}
    out = run_engine(tmp, name, spec | ({"cpu_async_scheduling": True} if drafter == "mtp" else {}))
    got, counters = _tokens(out), out["counters"]
    print(f"{name}: counters {counters}; repeats {_repeats(got, 0):.2f} / {_repeats(got, 1):.2f}")
    assert counters["accepted_per_pos"][1] > 0, counters
    settings = len(PENALTY_SETTINGS)
    samples = {"(s,t2,t3)": lambda i, t: (i % settings, t[1], t[2]),
               "(s,t3==t2)": lambda i, t: (i % settings, t[2] == t[1])}
    for label, key in samples.items():
        stat, p, dof = chi_square_two_sample([key(i, t) for i, t in enumerate(penalty_reference)],
                                             [key(i, t) for i, t in enumerate(got)])
        print(f"{name} {label}: chi2 {stat:.1f}, dof {dof}, p {p:.3g}")
        assert p > P_MIN, (label, stat, dof, p)


# A prompt longer than a block (128 tokens on CPU): with prefix caching every request after the first ones reads
# the first block's KV and GDN state from the cache.
LONG_PROMPT_LEN = 150


@pytest.fixture(scope="module")
def long_prompt():
    rng = random.Random(98)
    return [rng.randrange(10, 1000) for _ in range(LONG_PROMPT_LEN)]


@pytest.fixture(scope="module")
def long_reference(tmp, model, long_prompt):
    """Sampled continuations of the long prompt without speculation and without prefix caching, plus the greedy
    one (the planted drafter's oracle, in its own folder). Unseeded: the prompts are prefilled in chunks, and vLLM
    rewinds a seeded request's generator after a chunk, which its CPU generators cannot do."""
    greedy = {"prompt": long_prompt, "max_tokens": MAX_TOKENS + 1}
    ref = run_engine(tmp, "long_ref", {"model": model, "engine": {"max_num_seqs": 64},
                                       "requests": _sampled_requests(long_prompt, seeds=False) + [greedy]})
    (tmp / "long_oracle").mkdir(exist_ok=True)
    write_oracle(tmp / "long_oracle", [greedy], {"outputs": [ref["outputs"].pop()]})
    return ref


def test_sampled_outputs_with_prefix_caching_match_reference_distribution(tmp, model, long_prompt, long_reference):
    """Planted trees over a prompt read from the prefix cache: the 1st, 2nd and 3rd tokens follow vLLM's
    distribution without speculation and without the cache."""
    name = "sampled_planted_prefix_cached"
    engine = bole_engine(tmp / "long_oracle", name, depth=2, topk=3, budget=512, max_num_seqs=64,
                         enable_prefix_caching=True)
    out = run_engine(tmp, name, {"model": model, "engine": engine,
                                 "requests": _sampled_requests(long_prompt, seeds=False)})
    ref, got, counters = _tokens(long_reference), _tokens(out), out["counters"]
    cached = [o["cached_tokens"] for o in out["outputs"]]
    print(f"{name}: counters {counters}; requests with a cache hit {sum(c > 0 for c in cached)}")
    assert sum(c == 128 for c in cached) > NUM_REQUESTS // 2, Counter(cached)
    assert counters["accepted_per_pos"][1] > 0, counters
    samples = {"t1": lambda t: t[0], "t2": lambda t: t[1], "t3": lambda t: t[2], "(t1,t2)": lambda t: (t[0], t[1])}
    for label, key in samples.items():
        stat, p, dof = chi_square_two_sample([key(t) for t in ref], [key(t) for t in got])
        print(f"{name} {label}: chi2 {stat:.1f}, dof {dof}, p {p:.3g}")
        assert p > P_MIN, (label, stat, dof, p)
