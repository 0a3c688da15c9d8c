#!/usr/bin/env python3
"""Host time of vLLM's scheduler per engine step at the Qwen3.5-9B shape, by KV-cache grouping (CPU, no model).

    python3 benchmarks/scheduler_groups.py                      # 64 requests of 1024 prompt tokens, 5 nodes each
    python3 benchmarks/scheduler_groups.py --requests 32 --nodes 8 --out /tmp/groups.json

A Bole engine's ``kv_cache_groups`` setting picks its KV-cache groups: ``"fewest_bytes"`` (11 groups of 3 layers at
this shape) or ``"vllm"`` (vLLM's 4 groups of 9). vLLM's scheduler allocates every running request's slots group by
group, so its host time per step grows with the groups. This times what the engine core does between two model
steps, with the shape's real KV-cache config (``vllm_bole.testing.shape_specs``, 30 GiB) and no model: vLLM's
``Scheduler.schedule``, ``update_from_output`` (every request accepts ``--accepted`` of its drafts) and
``update_draft_token_ids`` (``--nodes`` draft tokens per request). ``--requests`` prompts of ``--prompt-len`` tokens
arrive at once and are prefilled in chunks of ``max_num_batched_tokens`` (8192) beside the running ones ("prefill"
steps), then decode together ("decode" steps). The two groupings alternate over ``--repeats`` rounds; the table
gives the median step of each kind over all rounds. Results: ``--out`` (JSON).
"""

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GROUPINGS = ("fewest_bytes", "vllm")
KV_CACHE_BYTES = 30 << 30


def scheduler_of(grouping: str, requests: int):
    """vLLM's scheduler over the 9B shape's KV-cache config with ``grouping``; (scheduler, number of groups)."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs, resolve_kv_cache_block_sizes
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from vllm_bole.testing.shape_specs import engine_config, layer_specs

    cfg = engine_config({"method": "bole", "kv_cache_groups": grouping})
    cfg.scheduler_config.max_num_seqs = requests
    kv = get_kv_cache_configs(cfg, [layer_specs(cfg, 0, True)], [KV_CACHE_BYTES])[0]
    cfg.cache_config.num_gpu_blocks = kv.num_blocks
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv, cfg)
    sched = Scheduler(cfg, kv, StructuredOutputManager(cfg), block_size=block_size, hash_block_size=hash_block_size)
    return sched, len(kv.kv_cache_groups)


def run_once(grouping: str, args) -> dict:
    """Step times (ms) of one scheduler life: {"groups", "decode": [...], "prefill": [...]}."""
    from vllm import SamplingParams
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
    from vllm.v1.request import Request

    sched, groups = scheduler_of(grouping, args.requests)
    params = SamplingParams(max_tokens=1 << 20, ignore_eos=True, temperature=0)
    prompt = list(range(1, args.prompt_len + 1))
    for i in range(args.requests):
        sched.add_request(Request(f"r{i}", prompt, params, None, arrival_time=time.time()))
    token = 7
    steps = {"decode": [], "prefill": []}
    for _ in range(args.steps):
        start = time.perf_counter()
        out = sched.schedule()
        ids = [r.req_id for r in out.scheduled_new_reqs] + list(out.scheduled_cached_reqs.req_ids)
        prefilling = False
        sampled = []
        for rid in ids:
            req = sched.requests[rid]
            done = req.num_computed_tokens + out.num_scheduled_tokens[rid] >= req.num_tokens
            prefilling |= not done
            drafts = len(out.scheduled_spec_decode_tokens.get(rid, ()))
            sampled.append([token] * (min(args.accepted, drafts) + 1) if done else [])
        sched.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                        sampled_token_ids=sampled))
        decoding = [r.request_id for r in sched.running if r.num_computed_tokens >= r.num_prompt_tokens]
        sched.update_draft_token_ids(DraftTokenIds(decoding, [[token] * args.nodes for _ in decoding]))
        steps["prefill" if prefilling or out.scheduled_new_reqs else "decode"].append(
            1e3 * (time.perf_counter() - start))
    return {"groups": groups, **steps}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--nodes", type=int, default=5, help="draft tokens per request and step")
    p.add_argument("--accepted", type=int, default=3, help="drafts accepted per request and step")
    p.add_argument("--steps", type=int, default=200, help="scheduler steps per round")
    p.add_argument("--repeats", type=int, default=3, help="rounds, the groupings alternating")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/scheduler_groups_cpu.json"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from vllm_bole import plugin

    plugin.register()
    runs = {g: {"groups": None, "decode": [], "prefill": []} for g in GROUPINGS}
    for _ in range(args.repeats):
        for grouping in GROUPINGS:
            got = run_once(grouping, args)
            runs[grouping]["groups"] = got["groups"]
            runs[grouping]["decode"] += got["decode"]
            runs[grouping]["prefill"] += got["prefill"]
    rows = [{"kv_cache_groups": g, "groups": r["groups"], "decode_steps": len(r["decode"]),
             "decode_step_ms": round(statistics.median(r["decode"]), 3), "prefill_steps": len(r["prefill"]),
             "prefill_step_ms": round(statistics.median(r["prefill"]), 3) if r["prefill"] else None}
            for g, r in runs.items()]
    print("| kv_cache_groups | groups | decode step ms (median) | prefill step ms (median) |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['kv_cache_groups']} | {r['groups']} | {r['decode_step_ms']:.2f} | {r['prefill_step_ms']:.2f} |")
    result = {"benchmark": "scheduler_groups", "command": " ".join(["python3 benchmarks/scheduler_groups.py",
                                                                    *(argv if argv is not None else sys.argv[1:])]),
              "settings": {k: v for k, v in vars(args).items() if k != "out"}, "kv_cache_bytes": KV_CACHE_BYTES,
              "cpu": platform.processor() or platform.machine(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
