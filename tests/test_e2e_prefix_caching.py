"""Prefix caching with Bole (vLLM's "align" mode for hybrid models): multi-turn conversations, interleaved.

Each turn's prompt is the previous turn's prompt and output plus a reply, so a turn reads the GDN states its
conversation's earlier turns left at block boundaries, among them boundaries that steps of several accepted tokens
crossed (written by the commit into the boundary's block, ``attention/gdn.py``). Greedy outputs equal vLLM's
without speculation, with and without prefix caching; Bole's hits are those of vLLM's MTP rule (the last matching
block is recomputed for the drafter: one block fewer than without speculation); the KV cache is back to empty.
"""

import json

import pytest

from e2e_support import assert_same_logprobs, bole_engine, first_divergences, run_engine, vocab_size
from vllm_bole.testing.tiny_models import tiny_model_dir

pytestmark = pytest.mark.vllm

PROMPT_LENS, REPLY_LEN, MAX_TOKENS, TURNS = (100, 104, 108), 40, 200, 3


def _spec(model, prompts, replies, **engine):
    return {"model": model, "prompts": prompts, "replies": replies, "max_tokens": MAX_TOKENS, "logprobs": 2,
            "engine": {"max_model_len": 1024, **engine}}


def _assert_same_conversations(ref: dict, test: dict) -> None:
    """Every turn's outputs equal, but for bf16 near-ties; a conversation that met one is compared no further (its
    next prompts differ)."""
    diverged = set()
    for turn, (a, b) in enumerate(zip(ref["turns"], test["turns"], strict=True)):
        keep = [i for i in range(len(a["outputs"])) if i not in diverged]
        divs = first_divergences({"outputs": [a["outputs"][i] for i in keep]},
                                 {"outputs": [b["outputs"][i] for i in keep]})
        real = [d for d in divs if not d.near_tie]
        assert not real, f"turn {turn + 1}: outputs differ beyond bf16 near-ties: {real}"
        # (the tiny models' logits hardly depend on the GDN state: test_block_checkpoints.py checks the states)
        assert_same_logprobs({"outputs": [a["outputs"][i] for i in keep]}, {"outputs": [b["outputs"][i] for i in keep]})
        diverged |= {keep[d.request] for d in divs}
    assert len(diverged) <= 1, f"near-ties in {len(diverged)} conversations"


def test_multi_turn_conversations_with_prefix_caching(tmp_path):
    import random

    model = tiny_model_dir("qwen3_5")
    vocab, rng = vocab_size(model), random.Random(7)
    prompts = [[rng.randrange(10, vocab) for _ in range(n)] for n in PROMPT_LENS]
    replies = [[[rng.randrange(10, vocab) for _ in range(REPLY_LEN)] for _ in PROMPT_LENS] for _ in range(TURNS - 1)]

    plain = run_engine(tmp_path, "ar", _spec(model, prompts, replies, enable_prefix_caching=False),
                       runner="multi_turn_run")
    cached = run_engine(tmp_path, "ar_cached", _spec(model, prompts, replies, enable_prefix_caching=True),
                        runner="multi_turn_run")
    _assert_same_conversations(plain, cached)
    # The planted drafter hides the reference's tokens in its trees: deep acceptance, paths crossing boundaries.
    oracle = [{"prompt": t["prompt_ids"], "output": t["tokens"]} for turn in plain["turns"] for t in turn["outputs"]]
    (tmp_path / "oracle.json").write_text(json.dumps(oracle))
    planted = run_engine(tmp_path, "bole_planted", _spec(
        model, prompts, replies, enable_prefix_caching=True,
        **bole_engine(tmp_path, "bole_planted", depth=6, topk=2, budget=64)), runner="multi_turn_run")
    mtp = run_engine(tmp_path, "bole_mtp", _spec(
        model, prompts, replies, enable_prefix_caching=True, speculative_config={"method": "bole"}),
        runner="multi_turn_run")
    for bole in (planted, mtp):
        _assert_same_conversations(plain, bole)
        assert bole["kv_cache_usage_end"] == 0, bole["kv_cache_usage_end"]

    block = cached["block_size"]
    stats = [json.loads(line) for line in (tmp_path / "bole_planted.stats.jsonl").read_text().splitlines()]
    assert max(s["depth"] for s in stats) >= 5, "the planted trees should reach deep"
    n = len(PROMPT_LENS)
    for turn in (1, 2):
        # Full blocks of each conversation's prompt this turn; without speculation all of them hit.
        full = [len(t["prompt_ids"]) // block for t in plain["turns"][turn]["outputs"]]
        assert cached["turns"][turn]["prefix_cache_hits"] == sum(full) * block
        # Bole: vLLM's MTP rule leaves one block out; the rest were written by its commit (turn 2: 128 and the
        # boundaries after it were crossed inside steps of the first turn's decode).
        for bole in (planted, mtp):
            assert bole["turns"][turn]["prefix_cache_hits"] == (sum(full) - n) * block, (turn, bole["turns"][turn])
