"""Prefix caching with Bole (vLLM's "align" mode for hybrid models): multi-turn conversations, interleaved.

Each turn's prompt is the previous turn's prompt and output plus a reply, so a turn reads the GDN states its
conversation's earlier turns left at block boundaries, among them boundaries that steps of several accepted tokens
crossed (written by the commit into the boundary's block, ``attention/gdn.py``). Greedy outputs equal vLLM's
without speculation, with and without prefix caching; Bole's queries and hits are those of vLLM without speculation
(not those of vLLM's rule for its MTP drafter, which computes the last matching block again); the KV cache is back
to empty. Second turns after first prompts of several blocks hit every block the first turn computed, also where a
boundary was crossed in a request's last step. Then requests sharing cached blocks are preempted and aborted.
"""

import json
import random

import pytest
import torch

from e2e_support import (assert_graphs_used, assert_same_logprobs, bole_engine, first_divergences, run_engine,
                          skip_without_moe_kernels, vocab_size, write_oracle)
from vllm_bole.testing.tiny_models import tiny_model_dir

pytestmark = pytest.mark.vllm

PROMPT_LENS, REPLY_LEN, MAX_TOKENS, TURNS = (100, 104, 108), 40, 200, 3
# vLLM sizes the tiny model's blocks by its GDN state (the attention page at least the state's): 128 tokens on CPU,
# 80 on an H100. One size everywhere keeps each test's block boundaries where its lengths put them.
BLOCK = 128


def _conversations(vocab: int, prompt_lens=PROMPT_LENS, turns=TURNS) -> tuple[list, list]:
    """Each conversation's first prompt and its replies of the later turns."""
    rng = random.Random(7)
    prompts = [[rng.randrange(10, vocab) for _ in range(n)] for n in prompt_lens]
    replies = [[[rng.randrange(10, vocab) for _ in range(REPLY_LEN)] for _ in prompt_lens] for _ in range(turns - 1)]
    return prompts, replies


def _spec(model, prompts, replies, kind="qwen3_5", max_tokens=MAX_TOKENS, **engine):
    return {"model": model, "kind": kind, "prompts": prompts, "replies": replies, "max_tokens": max_tokens,
            "logprobs": 2, "engine": {"max_model_len": 1024, "block_size": BLOCK, **engine}}


def _write_oracle(tmp_path, plain: dict) -> None:
    """The planted drafter hides the reference's tokens in its trees: deep acceptance, paths crossing boundaries."""
    oracle = [{"prompt": t["prompt_ids"], "output": t["tokens"]} for turn in plain["turns"] for t in turn["outputs"]]
    (tmp_path / "oracle.json").write_text(json.dumps(oracle))


def _assert_hits(run: dict, dropped_blocks: int) -> None:
    """Every request of a later turn hits every full block its conversation's previous turn computed (all of that
    turn's tokens but its last) but ``dropped_blocks`` (the first turn's prompts are shorter than a block). Under
    synchronous scheduling vLLM's counters say the same: each turn's queries are its prompts' tokens and its hits
    their sum. (Under async scheduling, vLLM's default on a GPU, its offline engine reports the counters of its
    first ``generate`` call only, without speculation too.)"""
    block = run["block_size"]
    assert block == BLOCK, block
    previous = None
    for turn, outputs in enumerate(t["outputs"] for t in run["turns"]):
        lens = [len(o["prompt_ids"]) for o in outputs]
        want = [(min(n, len(p["prompt_ids"]) + len(p["tokens"]) - 1) // block - dropped_blocks) * block
                for n, p in zip(lens, previous, strict=True)] if turn else [0] * len(lens)
        previous = outputs
        assert [o["cached_tokens"] for o in outputs] == want, (turn, want)
        if not run["async_scheduling"]:
            # vLLM counts the tokens of each lookup: once per request here, where every request is scheduled at
            # its first lookup (one that waits is looked up and counted again each step) and in a step with
            # outputs (the offline engine drops the counts of a step without).
            counts = {k: v for k, v in run["turns"][turn].items() if k != "outputs"}
            assert (counts["prefix_cache_queries"], counts["prefix_cache_hits"]) == (sum(lens), sum(want)), \
                (turn, counts)


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


def _states_out(tmp_path, name: str) -> dict:
    """Spec keys that have ``multi_turn_run`` save the GDN states of the prefix cache (``cached_gdn_states``)."""
    return {"states_out": str(tmp_path / f"{name}.states.pt")}


def _assert_same_cached_states(tmp_path, ref: str, name: str, tol: float = 0.05) -> None:
    """The prefix cache holds the same GDN state blocks as run ``ref``'s (by block hash: the engines ran with one
    PYTHONHASHSEED), each with the same conv and SSM states within bf16 rounding (one step of the conv state's bf16
    is 1/64 at its magnitudes; a boundary block left with an earlier step's running state differed by 3.8 or more):
    the states a later hit starts from. The tiny models' outputs hardly depend on the GDN state, so equal outputs and
    logprobs alone passed with every boundary block left unwritten."""
    want = torch.load(tmp_path / f"{ref}.states.pt")
    got = torch.load(tmp_path / f"{name}.states.pt")
    assert set(got) == set(want) and all(want.values()), (name, sorted(got), sorted(want))
    for layer, blocks in want.items():
        assert set(got[layer]) == set(blocks), (name, layer, len(got[layer]), len(blocks))
        for block, states in blocks.items():
            diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(states, got[layer][block]))
            assert diff <= tol, (name, layer, block, diff)


def test_multi_turn_conversations_with_prefix_caching(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")   # (the same block hashes in every engine)
    model = tiny_model_dir("qwen3_5")
    prompts, replies = _conversations(vocab_size(model))

    plain = run_engine(tmp_path, "ar", _spec(model, prompts, replies, enable_prefix_caching=False),
                       runner="multi_turn_run")
    cached = run_engine(tmp_path, "ar_cached", {**_spec(model, prompts, replies, enable_prefix_caching=True),
                                                **_states_out(tmp_path, "ar_cached")}, runner="multi_turn_run")
    _assert_same_conversations(plain, cached)
    _write_oracle(tmp_path, plain)
    planted = run_engine(tmp_path, "bole_planted", {**_spec(
        model, prompts, replies, enable_prefix_caching=True,
        **bole_engine(tmp_path, "bole_planted", depth=6, topk=2, budget=64)),
        **_states_out(tmp_path, "bole_planted")}, runner="multi_turn_run")
    mtp = run_engine(tmp_path, "bole_mtp", {**_spec(
        model, prompts, replies, enable_prefix_caching=True, speculative_config={"method": "bole"}),
        **_states_out(tmp_path, "bole_mtp")}, runner="multi_turn_run")
    for name, bole in (("bole_planted", planted), ("bole_mtp", mtp)):
        _assert_same_conversations(plain, bole)
        _assert_same_cached_states(tmp_path, "ar_cached", name)
        assert bole["kv_cache_usage_end"] == 0, bole["kv_cache_usage_end"]
    # The MTP drafter drafts before the walk (early_drafting): its commit finds the boundaries' nodes on the device.
    assert mtp["early_draft_steps"] > 0 and planted["early_draft_steps"] == 0, \
        (mtp["early_draft_steps"], planted["early_draft_steps"])
    assert_graphs_used(planted)   # (GPU: tree-only steps replayed their verification graphs)
    assert_graphs_used(mtp, drafter=True)

    _assert_deep_trees(tmp_path / "bole_planted.stats.jsonl")
    # Every full block hits, with Bole too: boundaries after the first prompts' were crossed inside steps of the
    # first turn's decode (written by the commit).
    for run in (cached, planted, mtp):
        _assert_hits(run, dropped_blocks=0)


def test_multi_turn_conversations_with_prefix_caching_async(tmp_path, monkeypatch):
    """The same conversations under async scheduling (on CPU through ``engine_run.force_cpu_async_scheduling``):
    vLLM schedules each step before the last one's tokens exist, with one placeholder per draft, and corrects the
    host's computed counts by the rejected drafts before it builds the step's metadata, so the block boundaries
    the commit fills are where they are synchronously. The MTP drafter drafts before the walk, the planted one after
    the host walk. Outputs, hits and the GDN states of the cached blocks are vLLM's without speculation. (Under async
    scheduling vLLM's offline engine reports the prefix-cache counters of its first ``generate`` call only, without
    speculation too: the hits are read per request, from each output's ``num_cached_tokens``.)"""
    monkeypatch.setenv("PYTHONHASHSEED", "0")   # (the same block hashes in every engine)
    model = tiny_model_dir("qwen3_5")
    prompts, replies = _conversations(vocab_size(model))
    cached = run_engine(tmp_path, "ar_cached", {**_spec(model, prompts, replies, enable_prefix_caching=True),
                                               **_states_out(tmp_path, "ar_cached")}, runner="multi_turn_run")
    _write_oracle(tmp_path, cached)
    runs = {}
    for name, engine in (("bole_planted", bole_engine(tmp_path, "bole_planted", depth=6, topk=2, budget=64)),
                         ("bole_mtp", {"speculative_config": {"method": "bole"}})):
        spec = {**_spec(model, prompts, replies, enable_prefix_caching=True, async_scheduling=True, **engine),
                "cpu_async_scheduling": True, **_states_out(tmp_path, name)}
        runs[name] = run_engine(tmp_path, name, spec, runner="multi_turn_run")
    for name, bole in runs.items():
        assert bole["async_scheduling"], name
        _assert_same_conversations(cached, bole)
        _assert_same_cached_states(tmp_path, "ar_cached", name)
        _assert_hits(bole, dropped_blocks=0)
        assert bole["kv_cache_usage_end"] == 0, (name, bole["kv_cache_usage_end"])
    # (these requests want logprobs, so the MTP drafter's walks come to the host: no device-output steps)
    assert runs["bole_mtp"]["early_draft_steps"] > 0 and runs["bole_planted"]["early_draft_steps"] == 0
    _assert_deep_trees(tmp_path / "bole_planted.stats.jsonl")
    # Without logprobs the walks stay on the device (device-output steps): the commit finds the boundaries' nodes
    # there, and the host never sees the paths.
    spec = {**_spec(model, prompts, replies, enable_prefix_caching=True, async_scheduling=True,
                    speculative_config={"method": "bole"}),
            "logprobs": None, "cpu_async_scheduling": True, **_states_out(tmp_path, "bole_device")}
    device = run_engine(tmp_path, "bole_device", spec, runner="multi_turn_run")
    assert device["device_output_steps"] > 0, device
    assert [[o["tokens"] for o in t["outputs"]] for t in device["turns"]] == \
        [[o["tokens"] for o in t["outputs"]] for t in cached["turns"]]
    _assert_same_cached_states(tmp_path, "ar_cached", "bole_device")
    _assert_hits(device, dropped_blocks=0)


def test_turns_prefilled_beside_trees_with_prefix_caching(tmp_path, monkeypatch):
    """Ten conversations of one to three blocks, two turns, at most 256 tokens a step: each turn's prompts run in
    chunks while the conversations already prefilled decode, so the MTP drafter drafts mixed steps before the walk
    (their trees' commit writes the boundaries, their completed prompts grow first trees). Outputs, each request's
    cached tokens and the cached GDN states are vLLM's without speculation at the same step budget."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")   # (the same block hashes in every engine)
    model = tiny_model_dir("qwen3_5")
    prompts, replies = _conversations(vocab_size(model), LONG_PROMPT_LENS, turns=2)
    chunked = {"enable_prefix_caching": True, "max_num_batched_tokens": 256}
    engines = {"ar_cached": chunked, "bole_mtp": chunked | {"speculative_config": {"method": "bole"}}}
    runs = {name: run_engine(tmp_path, name, {**_spec(model, prompts, replies, max_tokens=60, **engine),
                                              **_states_out(tmp_path, name)}, runner="multi_turn_run")
            for name, engine in engines.items()}
    cached, bole = runs.values()
    print(f"bole_mtp: early {bole['early_draft_steps']}, mixed {bole['early_mixed_steps']}; cached tokens "
          f"{[[o['cached_tokens'] for o in t['outputs']] for t in bole['turns']]}")
    _assert_same_conversations(cached, bole)
    _assert_same_cached_states(tmp_path, "ar_cached", "bole_mtp")
    assert [[o["cached_tokens"] for o in t["outputs"]] for t in bole["turns"]] == \
        [[o["cached_tokens"] for o in t["outputs"]] for t in cached["turns"]]
    assert sum(o["cached_tokens"] for o in bole["turns"][1]["outputs"]) > 0
    assert bole["kv_cache_usage_end"] == 0, bole["kv_cache_usage_end"]
    assert bole["early_mixed_steps"] > 0 and bole["early_draft_steps"] > bole["early_mixed_steps"], bole


def _assert_deep_trees(stats_path) -> None:
    stats = [json.loads(line) for line in stats_path.read_text().splitlines()]
    assert max(s["depth"] for s in stats) >= 5, "the planted trees should reach deep"


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_next"])
def test_moe_multi_turn_with_prefix_caching(tmp_path, kind):
    """The same conversations on the tiny MoE models (Qwen3.5-MoE, Qwen3-Next; GDN + attention): Bole with prefix
    caching equals vLLM without speculation, with the queries and hits it has on Qwen3.5."""
    skip_without_moe_kernels()
    model = tiny_model_dir(kind)
    prompts, replies = _conversations(vocab_size(model))
    plain = run_engine(tmp_path, "ar", _spec(model, prompts, replies, kind, enable_prefix_caching=False),
                       runner="multi_turn_run")
    _write_oracle(tmp_path, plain)
    planted = run_engine(tmp_path, "bole_planted", _spec(
        model, prompts, replies, kind, enable_prefix_caching=True,
        **bole_engine(tmp_path, "bole_planted", depth=6, topk=2, budget=64)), runner="multi_turn_run")
    _assert_same_conversations(plain, planted)
    assert planted["kv_cache_usage_end"] == 0, planted["kv_cache_usage_end"]
    _assert_deep_trees(tmp_path / "bole_planted.stats.jsonl")
    _assert_hits(planted, dropped_blocks=0)


# First prompts of one to three blocks, and outputs crossing two or three boundaries: 57, 185 and 313 tokens end
# their first turn (200 output tokens) exactly on a boundary, whose block the last step completes.
LONG_PROMPT_LENS, LONG_MAX_TOKENS = (300, 200, 150, 60, 57, 59, 61, 63, 185, 313), 200


def _second_turn_hit(prompt: int, output: int, block: int) -> int:
    """vLLM's prefix-cache hit without speculation, in tokens, on the second turn of a conversation whose first turn
    prefilled ``prompt`` tokens (not a multiple of ``block``), within one step's token budget, and generated
    ``output`` (the reply makes the second prompt longer than both): every block the first turn computed (it never
    computes its last token), as the last block boundary with a cached GDN state. Such a state is cached where a
    prefill chunk ended on the boundary (vLLM ends a prompt's first chunk at its last block boundary,
    ``Scheduler._mamba_block_aligned_split``) or a decode step reached it (crossed inside a step of several tokens:
    the commit writes it, and it is published, after a request's last step too)."""
    computed = prompt + output - 1
    cached = {prompt // block * block, *range((prompt // block + 1) * block, computed + 1, block)}
    return max((b for b in cached if 0 < b <= computed // block * block), default=0)


def test_second_turn_hits_at_prefill_and_last_step_boundaries(tmp_path):
    """Two turns of conversations whose first prompts span one to three blocks. Without speculation and with Bole
    each second turn hits every block the first turn computed (3200 tokens with 128-token blocks; with vLLM's rule
    for an MTP drafter, the last matching block dropped and the boundary before it cached only where a chunk or step
    ended on or crossed it, Bole hit 1024 of the first 2304). Where a last step completes a block with accepted
    drafts, the scheduler publishes it as the request finishes (``tests/test_prefix_cache_publish.py``: whether a last
    step here does depends on where the steps fall)."""
    model = tiny_model_dir("qwen3_5")
    prompts, replies = _conversations(vocab_size(model), LONG_PROMPT_LENS, turns=2)
    cached = run_engine(tmp_path, "ar_cached", _spec(model, prompts, replies, max_tokens=LONG_MAX_TOKENS,
                                                     enable_prefix_caching=True), runner="multi_turn_run")
    _write_oracle(tmp_path, cached)
    planted = run_engine(tmp_path, "bole_planted", _spec(
        model, prompts, replies, max_tokens=LONG_MAX_TOKENS, enable_prefix_caching=True,
        **bole_engine(tmp_path, "bole_planted", depth=6, topk=2, budget=64)), runner="multi_turn_run")
    _assert_same_conversations(cached, planted)
    assert planted["kv_cache_usage_end"] == 0, planted["kv_cache_usage_end"]
    assert_graphs_used(planted)
    _assert_deep_trees(tmp_path / "bole_planted.stats.jsonl")
    block = planted["block_size"]
    hits = [_second_turn_hit(n, LONG_MAX_TOKENS, block) for n in LONG_PROMPT_LENS]
    for run in (cached, planted):
        assert [[o["cached_tokens"] for o in t["outputs"]] for t in run["turns"]] == [[0] * len(hits), hits]
        if not run["async_scheduling"]:   # (vLLM's offline counters: _assert_hits)
            first, second = ({k: v for k, v in turn.items() if k != "outputs"} for turn in run["turns"])
            lens = [len(t["prompt_ids"]) for t in run["turns"][1]["outputs"]]
            assert (first["prefix_cache_queries"], second["prefix_cache_queries"]) == (sum(LONG_PROMPT_LENS),
                                                                                       sum(lens))
            assert (first["prefix_cache_hits"], second["prefix_cache_hits"]) == (0, sum(hits)), (first, second, hits)


# Every request starts with the same system prompt (two full blocks); 24 blocks of KV cache hold one or two of them
# (each takes blocks in every KV-cache group: per 128 tokens in the attention groups, and in each GDN group one or
# two: a request at max_model_len takes 15 blocks), so most wait and vLLM preempts running ones as they grow.
SYSTEM_LEN, SUFFIX_LENS, SHARED_MAX_TOKENS = 300, (10, 40, 25, 70, 5, 55), 40
SMALL_CACHE = {"enable_prefix_caching": True, "num_gpu_blocks_override": 24, "max_model_len": 512,
               "block_size": BLOCK}


def test_preempted_and_aborted_requests_sharing_cached_blocks(tmp_path):
    """Requests that share cached blocks are preempted (their own blocks freed, the shared ones kept for the others
    and hit again on resuming) and two are aborted (after 3 and after 6 engine steps: one mid-generation, one still
    waiting), in two rounds (the second reads the first's cached blocks); then two more requests with the same system
    prompt run in the space left. The others' greedy outputs equal vLLM's without speculation, the engine frees every
    block once (one freed twice fails vLLM's block-pool assertion when it is handed out again) and ends with an empty
    KV cache."""
    model = tiny_model_dir("qwen3_5")
    vocab, rng = vocab_size(model), random.Random(11)
    system = [rng.randrange(10, vocab) for _ in range(SYSTEM_LEN)]
    prompts = [system + [rng.randrange(10, vocab) for _ in range(n)] for n in SUFFIX_LENS + (30, 15)]
    requests = [{"prompt": p, "max_tokens": SHARED_MAX_TOKENS} for p in prompts]
    ref = run_engine(tmp_path, "ref", {"model": model, "requests": requests, "logprobs": 1,
                                        "engine": {"max_model_len": 512}})
    write_oracle(tmp_path, requests, ref)
    engine = bole_engine(tmp_path, "bole", depth=6, topk=2, budget=64, **SMALL_CACHE)
    n, abort = len(SUFFIX_LENS), [1, 4]
    out = run_engine(tmp_path, "bole", {"model": model, "engine": engine, "requests": requests[:n], "abort": abort,
                                        "after_steps": [3, 6], "after": requests[n:], "logprobs": 1},
                     runner="abort_run")
    print("counters", out["counters"], "aborted with outputs", [r["aborted_outputs"] for r in out["rounds"]])
    assert any(0 < k < SHARED_MAX_TOKENS for r in out["rounds"] for k in r["aborted_outputs"]), "none aborted midway"
    kept = [i for i in range(n) if i not in abort]
    for rnd in out["rounds"]:
        want = {"outputs": [ref["outputs"][i] for i in kept]}
        assert [o["tokens"] for o in rnd["outputs"]] == [o["tokens"] for o in want["outputs"]], rnd["after_steps"]
        assert_same_logprobs(want, rnd)
    want = {"outputs": ref["outputs"][n:]}
    assert [o["tokens"] for o in out["after"]] == [o["tokens"] for o in want["outputs"]]
    counters = out["counters"]
    assert counters["num_preemptions"] > 0, counters
    assert counters["prefix_cache_hits"] > 0, counters
    assert counters["kv_cache_usage_perc"] == 0 and out["held"]["kv_cache_usage"] == 0, (counters, out["held"])
    assert not out["held"]["scheduler_requests"], out["held"]
