"""Calibrate Bole's per-step node budget for one model on this GPU (``vllm-bole calibrate``).

    vllm-bole calibrate --model Qwen/Qwen3.5-9B --batch-sizes 1,4,8,16,32,64 --kv-lens 256,1024,4096
    python -m vllm_bole.calibration --model DIR --engine-args '{"load_format": "dummy"}'

Starts one in-process engine with the Bole speculative config to be served (``--speculative-config``; its depth
and topk bound the nodes per request), times the target forward of verification steps of N nodes against the
plain decode step for every batch size and KV length (see :mod:`vllm_bole.calibration.sweep`), merges
B_ver = max{N : T_ver(N) <= (1 + epsilon) T_dec} into the table that ``budget: "auto"`` reads (``--out``; schema
in :mod:`vllm_bole.spec_decode.budget_table`), prints a summary and saves a plot of T_ver(N)/T_dec when matplotlib is
installed. Pass the engine settings you serve with (``--engine-args``: CUDA-graph sizes, dtype, ...): they are
part of what is measured.
"""

import argparse
import json
import os
import sys

from .sweep import DEFAULT_NODES, SweepPlan
from ..spec_decode.budget_table import default_table_path


def _ints(text: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _json_dict(text: str) -> dict:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="vllm-bole calibrate", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint (HF name or directory)")
    parser.add_argument("--speculative-config", type=_json_dict, default={"method": "bole"},
                        help='Bole settings as served (JSON), e.g. \'{"method": "bole", "topk": 4}\'')
    parser.add_argument("--engine-args", type=_json_dict, default={}, help="more vllm.LLM keyword arguments (JSON)")
    parser.add_argument("--batch-sizes", type=_ints, default=[1, 4, 8, 16, 32, 64])
    parser.add_argument("--kv-lens", type=_ints, default=[256, 1024, 4096], help="context lengths (prompt tokens)")
    parser.add_argument("--nodes", type=_ints, default=list(DEFAULT_NODES), help="grid of N (tree nodes per step)")
    parser.add_argument("--epsilon", type=float, default=0.1, help="allowed slowdown over the plain decode step")
    parser.add_argument("--warmup", type=int, default=3, help="steps dropped per point")
    parser.add_argument("--steps", type=int, default=10, help="steps timed per point (median)")
    parser.add_argument("--shape", choices=("beam", "kary", "chain"), default="beam", help="tree shape")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help=f"table to merge into (default {default_table_path()})")
    parser.add_argument("--plot", default=None, help="PNG of T_ver(N)/T_dec (default: next to --out)")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def engine_kwargs_for(args, plan: SweepPlan) -> dict:
    """LLM keyword arguments: sized for the sweep, then the user's ``--engine-args``."""
    from ..config import parse_bole_config

    spec = {**args.speculative_config, "method": "bole"}
    cfg, _ = parse_bole_config(spec)
    per_request = cfg.max_nodes_per_request
    steps = plan.decode_steps(len(plan.nodes))
    kwargs = {"speculative_config": spec, "max_num_seqs": max(plan.batch_sizes),
              "max_model_len": max(plan.kv_lens) + steps + 16 + per_request,
              "max_num_batched_tokens": max(2048, max(plan.batch_sizes) + min(max(plan.nodes),
                                                                              max(plan.batch_sizes) * per_request)),
              "enable_prefix_caching": False}
    # The sweep steps the engine one step at a time and sets each step's forest itself: synchronous scheduling
    # (what it times, the target forward, does not depend on it).
    return kwargs | args.engine_args | {"async_scheduling": False}


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    if args.epsilon < 0 or args.warmup < 0 or args.steps < 1:
        print("vllm-bole calibrate: --epsilon and --warmup must be >= 0 and --steps >= 1", file=sys.stderr)
        return 2
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the sweep drives the runner in this process
    plan = SweepPlan(batch_sizes=args.batch_sizes, kv_lens=args.kv_lens, nodes=args.nodes, epsilon=args.epsilon,
                     warmup=args.warmup, steps=args.steps, shape=args.shape, seed=args.seed)
    from vllm import LLM

    from .sweep import calibrate, plot, save, summary

    llm = LLM(model=args.model, **engine_kwargs_for(args, plan))
    entries = calibrate(llm, plan, progress=not args.no_progress)
    out = args.out or default_table_path()
    save(entries, out)
    print(summary(entries))
    print(f"wrote {len(entries)} entries to {out}")
    png = args.plot or os.path.splitext(str(out))[0] + ".png"
    if plot(entries, png):
        print(f"plot: {png}")
    else:
        print("plot skipped (matplotlib is not installed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
