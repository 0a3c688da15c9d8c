"""Measure a model's acceptance by tree depth and sibling rank on its own drafts (``vllm-bole acceptance-profile``).

    vllm-bole acceptance-profile --model Qwen/Qwen3.5-9B --prompts prompts.txt --out acceptance_profile.json

Generates greedily from the prompts through vLLM with Bole, which drafts wide trees (by default depth 8, topk 4
and every request's whole tree of depth x topk nodes each step, so that deep levels and sibling ranks get trials),
records every verified tree with the target's tokens along its accepted path (``VLLM_BOLE_RECORD_WALKS``) and
writes a JSON profile (``calibration/acceptance_stats.py``): rank-1 acceptance per depth and the rank-1 chain's
unconditional curve, sibling ranks by rank and depth (counts, Wilson 95% intervals), the mean acceptance length of
chains of k = 1..8 drafts and of trees of a few node counts, and vLLM's spec-decode counters of the run. Its
``synthetic_acceptance`` block replays it: ``"synthetic_acceptance": {"profile": FILE}`` in a Bole speculative
config, or ``benchmarks/e2e.py --acceptance-profile FILE``.

``--prompts``: a text file of one prompt per line, or a JSON list of strings or token-id lists; default: the first
sentence of each paragraph of ``vllm_bole/testing/corpus.txt``. Greedy only. The engine runs in this process,
scheduled synchronously (under async scheduling the walks stay on the device), without tensor parallelism.
"""

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from ..spec_decode.synthetic import PROFILE_FORMAT
from .__main__ import _json_dict

DEFAULT_DEPTH, DEFAULT_TOPK = 8, 4


def default_prompts() -> list[str]:
    """The first sentence of each paragraph of the bundled corpus."""
    from ..testing.tiny_models import CORPUS_PATH

    paragraphs = [p.strip() for p in CORPUS_PATH.read_text().split("\n\n") if p.strip()]
    return [p.split(". ")[0].rstrip(".") + "." for p in paragraphs]


def read_prompts(path: str) -> list:
    """A JSON list of strings or token-id lists, else one prompt per non-empty line."""
    text = Path(path).read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        try:
            prompts = json.loads(text)
        except ValueError as e:
            raise SystemExit(f"--prompts: {path} starts like a JSON list but is not JSON ({e})") from None
        ok = isinstance(prompts, list) and all(
            isinstance(p, str) and p or isinstance(p, list) and p and all(isinstance(t, int) for t in p)
            for p in prompts)
        if not ok or not prompts:
            raise SystemExit(f"--prompts: {path} must be a non-empty JSON list of strings or token-id lists")
        return prompts
    prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise SystemExit(f"--prompts: {path} holds no prompt")
    return prompts


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="vllm-bole acceptance-profile",
                                               description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint (HF name or directory)")
    parser.add_argument("--prompts", default=None, help="one prompt per line, or a JSON list of strings or token-id "
                        "lists (default: the bundled corpus's opening sentences)")
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt")
    parser.add_argument("--ignore-eos", action="store_true", help="generate --max-tokens even past EOS")
    parser.add_argument("--depth", type=int, default=DEFAULT_DEPTH, help="num_speculative_tokens (deepest level)")
    parser.add_argument("--topk", type=int, default=DEFAULT_TOPK)
    parser.add_argument("--nodes-per-request", type=int, default=None,
                        help="tree nodes each request verifies per step (default: depth x topk, the whole tree)")
    parser.add_argument("--speculative-config", type=_json_dict, default={},
                        help='more Bole keys (JSON), e.g. \'{"draft_vocab": 32768}\'')
    parser.add_argument("--engine-args", type=_json_dict, default={}, help="more vllm.LLM keyword arguments (JSON)")
    parser.add_argument("--min-trials", type=int, default=20,
                        help="trials a depth or sibling rank needs to enter the replayed rates")
    parser.add_argument("--out", default="acceptance_profile.json", help="the profile (JSON)")
    parser.add_argument("--walks", default=None, help="also every recorded tree and walk here, one JSON object a "
                        "line (parents, tokens, scores, path, targets: spec_decode/walk_record.Walk)")
    return parser


def speculative_config(args, batch: int) -> dict:
    """Bole at ``--depth`` and ``--topk``, a fixed budget of ``--nodes-per-request`` per request of the batch, and
    the drafter's full vocabulary unless ``--speculative-config`` names a ``draft_vocab`` (a profile measures what
    the trees accept; a draft vocabulary's cost is its coverage, which ``synthetic_acceptance`` adds apart)."""
    per_request = args.nodes_per_request or args.depth * args.topk
    spec = {"method": "bole", "num_speculative_tokens": args.depth, "topk": args.topk,
            "budget": per_request * batch, "draft_vocab": None} | args.speculative_config
    if spec.get("synthetic_acceptance"):
        raise SystemExit("--speculative-config: a profile measures the target's acceptance; drop "
                         "synthetic_acceptance")
    if isinstance(spec["budget"], bool) or not isinstance(spec["budget"], int):
        raise SystemExit(f"--speculative-config: a profile needs a fixed budget (an integer), got {spec['budget']!r}")
    return spec


def run(args: argparse.Namespace) -> int:
    if min(args.max_tokens, args.depth, args.topk, args.nodes_per_request or 1, args.min_trials) < 1:
        print("vllm-bole acceptance-profile: --max-tokens, --depth, --topk, --nodes-per-request and --min-trials "
              "must be >= 1", file=sys.stderr)
        return 2
    if (args.nodes_per_request or 0) > args.depth * args.topk:
        print(f"vllm-bole acceptance-profile: --nodes-per-request is at most depth x topk = {args.depth * args.topk}",
              file=sys.stderr)
        return 2
    if args.engine_args.get("tensor_parallel_size", 1) != 1:
        raise SystemExit("--engine-args: the profile reads the walks from the one model runner of this process; "
                         "drop tensor_parallel_size")
    prompts = read_prompts(args.prompts) if args.prompts else default_prompts()
    # The runner keeps every walk, and the engine runs in this process, so that they can be read here.
    os.environ["VLLM_BOLE_RECORD_WALKS"] = "1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    from .._vllm_compat import model_runner_of
    from ..testing.greedy_check import spec_decode_counters
    from .acceptance_stats import profile_stats

    batch = args.engine_args.get("max_num_seqs", min(len(prompts), 16))
    spec = speculative_config(args, batch)
    engine = {"max_num_seqs": batch, "enable_prefix_caching": False} | args.engine_args
    engine |= {"speculative_config": spec, "disable_log_stats": False, "async_scheduling": False}
    llm = LLM(model=args.model, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    llm.generate([{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts], params, use_tqdm=False)
    log = model_runner_of(llm).bole_walk_log
    if not log.walks:
        print("vllm-bole acceptance-profile: no draft tree was verified (prompts too long for max_model_len, or "
              "--max-tokens too small?)", file=sys.stderr)
        return 1
    counters = spec_decode_counters(llm.get_metrics())
    depth = spec["num_speculative_tokens"]
    per_request = spec["budget"] // batch
    budgets = sorted({q for q in (1, 2, 4, 8, 16, 32, 64) if q < per_request} | {per_request})
    profile = {"format": PROFILE_FORMAT, "version": 1, "model": args.model,
               "sampling": "greedy", "prompts": len(prompts), "prompts_file": args.prompts,
               "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos, "speculative_config": spec,
               "engine_args": {k: v for k, v in engine.items() if k != "speculative_config"},
               "unrecorded_steps": log.unrecorded_steps,
               **profile_stats(log.walks, max_chain=depth, budgets=budgets, min_trials=args.min_trials),
               "vllm_counters": {k: counters[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens",
                                                         "mean_acceptance_length")}
               | {"accepted_per_pos": counters["accepted_per_pos"][:depth]}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=1) + "\n")
    if args.walks:
        with open(args.walks, "w") as f:
            f.writelines(json.dumps(dataclasses.asdict(w)) + "\n" for w in log.walks)
    print(summary(profile))
    if not profile["synthetic_acceptance"]["rates"]:
        print(f"too few trials at depth 1 for replayable rates (--min-trials {args.min_trials})", file=sys.stderr)
    print(f"wrote {out}")
    return 0


def summary(profile: dict) -> str:
    """A few lines: the replayable rates and the mean acceptance lengths."""
    syn = profile["synthetic_acceptance"]
    tree = profile["tree"]
    lines = [f"{tree['walks']} verified trees of {tree['mean_nodes']} nodes on average, mean acceptance length "
             f"{tree['mean_acceptance_length']}",
             "replayed rates: rank-1 chain, unconditional per depth: " + ", ".join(f"{r:.3f}" for r in syn["rates"]),
             "replayed rates: sibling ranks 2.., conditional: " + ", ".join(f"{r:.3f}" for r in syn["sibling_rates"]),
             "chain of k drafts, mean acceptance length: " + ", ".join(
                 f"k={c['k']} {c['mean_acceptance_length']:.2f}" for c in profile["chain_acceptance_length"]),
             "tree of q nodes, mean acceptance length: " + ", ".join(
                 f"q={b['nodes']} {b['mean_acceptance_length']:.2f}" for b in profile["tree_budgets"]),
             f"replayed on the same trees: {profile['replay']['mean_acceptance_length']} (measured "
             f"{profile['replay']['measured']})"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(run(build_parser().parse_args()))
