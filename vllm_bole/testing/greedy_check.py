"""Speculative decoding against plain greedy decoding on a tiny model, through vLLM.

    python -m vllm_bole.testing.greedy_check --kind qwen3_5 \\
        --spec '{"method": "mtp", "num_speculative_tokens": 3}'

Builds two engines in one process (plain, then speculative), decodes the same prompts
greedily with both and checks the speculative outputs the way vLLM's own spec-decode
tests do: identical up to the first divergence, which is accepted only where the plain
run's top-2 logprob gap is below ``tie_tol`` (a bf16 near-tie). Prints a JSON report
with the comparison, the spec-decode counters and the engine start times; exits 1 on
a real mismatch. ``VLLM_PLUGINS`` defaults to "" (stock vLLM); export it to load plugins.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import dataclass

PROMPTS = (
    "The river starts high in the hills",
    "A language model reads a piece of text and",
    "Hello there, my name is",
    "Computers are machines that follow instructions.",
    "In the evening the wind comes down from the hills, and",
    "Questions are the beginning of knowledge.",
    "User: Can you tell me a short story?\nAssistant:",
    "The market opens early",
)

# Logprob gap (nats) under which the plain run's top-2 counts as a near-tie. bf16
# logits near 20 are spaced 0.125 apart, so gaps of one or two steps can flip.
DEFAULT_TIE_TOL = 0.3


@dataclass
class GreedyOutput:
    token_ids: list[int]
    top2_gaps: list[float]  # per generated token: logprob(top-1) - logprob(top-2)


@dataclass
class Comparison:
    prompt_index: int
    status: str  # "identical", "near_tie" (diverged at a near-tie) or "mismatch"
    position: int | None = None  # first differing generated token
    gap: float | None = None  # reference top-2 gap there


def greedy_outputs(request_outputs) -> list[GreedyOutput]:
    """Token ids and top-2 gaps from ``LLM.generate`` run with ``logprobs >= 2``."""
    results = []
    for request in request_outputs:
        completion = request.outputs[0]
        gaps = []
        for step in completion.logprobs:
            top = sorted((lp.logprob for lp in step.values()), reverse=True)
            gaps.append(top[0] - top[1] if len(top) > 1 else float("inf"))
        results.append(GreedyOutput(list(completion.token_ids), gaps))
    return results


def compare_greedy(
    reference: list[GreedyOutput], candidate: list[GreedyOutput], tie_tol: float = DEFAULT_TIE_TOL
) -> list[Comparison]:
    comparisons = []
    for i, (ref, cand) in enumerate(zip(reference, candidate, strict=True)):
        pos = next(
            (j for j, (a, b) in enumerate(zip(ref.token_ids, cand.token_ids)) if a != b),
            None,
        )
        if pos is None and len(ref.token_ids) == len(cand.token_ids):
            comparisons.append(Comparison(i, "identical"))
            continue
        if pos is None:  # one is a prefix of the other
            comparisons.append(Comparison(i, "mismatch", min(len(ref.token_ids), len(cand.token_ids))))
            continue
        gap = ref.top2_gaps[pos]
        comparisons.append(Comparison(i, "near_tie" if gap < tie_tol else "mismatch", pos, gap))
    return comparisons


def spec_decode_counters(metrics) -> dict:
    """Spec-decode counters from ``LLM.get_metrics()`` (needs ``disable_log_stats=False``)."""
    names = {
        "vllm:spec_decode_num_drafts": "num_drafts",
        "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
    }
    counters: dict = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
    per_pos: list[int] = []
    for metric in metrics:
        if metric.name in names:
            counters[names[metric.name]] += metric.value
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            per_pos = [a + b for a, b in zip(per_pos, metric.values)] if per_pos else list(metric.values)
    counters["accepted_per_pos"] = per_pos
    drafts, draft_tokens = counters["num_drafts"], counters["num_draft_tokens"]
    counters["acceptance_rate"] = counters["num_accepted_tokens"] / draft_tokens if draft_tokens else None
    counters["acceptance_rate_per_pos"] = [a / drafts for a in per_pos] if drafts else []
    counters["mean_acceptance_length"] = 1 + counters["num_accepted_tokens"] / drafts if drafts else None
    return counters


def run_engine(model: str, kind: str, prompts, max_tokens: int, **llm_kwargs) -> dict:
    """Start an engine, decode ``prompts`` greedily, shut it down; returns outputs and timings."""
    from vllm import LLM, SamplingParams

    from vllm_bole.testing.tiny_models import engine_kwargs

    start = time.perf_counter()
    llm = LLM(model=model, disable_log_stats=False, **(engine_kwargs(kind) | llm_kwargs))
    started = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2, ignore_eos=True)
    request_outputs = llm.generate(list(prompts), params, use_tqdm=False)
    done = time.perf_counter()
    result = {
        "outputs": greedy_outputs(request_outputs),
        "texts": [r.outputs[0].text for r in request_outputs],
        "counters": spec_decode_counters(llm.get_metrics()),
        "start_s": round(started - start, 1),
        "generate_s": round(done - started, 2),
    }
    del llm
    gc.collect()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", default="qwen3_5", choices=("qwen3_5", "qwen3_5_moe", "qwen3_next"))
    parser.add_argument("--model", help="checkpoint directory (default: the cached tiny model)")
    parser.add_argument("--spec", default='{"method": "mtp", "num_speculative_tokens": 3}')
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--tie-tol", type=float, default=DEFAULT_TIE_TOL)
    parser.add_argument("--report", help="also write the JSON report here (vLLM logs to stdout)")
    args = parser.parse_args(argv)

    os.environ.setdefault("VLLM_PLUGINS", "")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from vllm_bole.testing.tiny_models import tiny_model_dir

    model = args.model or tiny_model_dir(args.kind)
    plain = run_engine(model, args.kind, PROMPTS, args.max_tokens)
    spec = run_engine(
        model, args.kind, PROMPTS, args.max_tokens, speculative_config=json.loads(args.spec)
    )
    comparisons = compare_greedy(plain["outputs"], spec["outputs"], args.tie_tol)
    report = {
        "model": model,
        "speculative_config": json.loads(args.spec),
        "comparisons": [c.__dict__ for c in comparisons],
        "spec_decode": spec["counters"],
        "engine_start_s": {"plain": plain["start_s"], "spec": spec["start_s"]},
        "generate_s": {"plain": plain["generate_s"], "spec": spec["generate_s"]},
        "plain_texts": plain["texts"],
        "min_top2_gap": min(min(o.top2_gaps) for o in plain["outputs"]),
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.report:
        with open(args.report, "w") as f:
            f.write(text + "\n")
    return 1 if any(c.status == "mismatch" for c in comparisons) else 0


if __name__ == "__main__":
    sys.exit(main())
