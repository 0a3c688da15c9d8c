#!/usr/bin/env python3
"""Prefix caching online: multi-turn, agent-like conversations through vLLM's OpenAI server, per configuration.

    python3 benchmarks/prefix_cache.py --smoke                     # CPU: the tiny Qwen3.5, ar and bole
    python3 benchmarks/prefix_cache.py --configs ar,mtp3,bole --conversations 32 --turns 6 \\
        --system-len 1024 --first-len 512 --append-len 256 --output-len 128 --kv-cache-gib 30   # GPU, 9B shape

The workload: ``--conversations`` conversations of ``--turns`` turns, all in flight at once (``--max-concurrency``
caps them). Every conversation starts with the same system prompt (``--system-len`` tokens) and its own first
message (``--first-len``); each later turn's prompt is the previous turn's prompt, the previous turn's output
(``--output-len`` tokens, ``ignore_eos``, greedy) and a tool-output-sized append (``--append-len``), so each turn
re-sends its whole context, as a chat or agent client does. Prompts are token ids (``/v1/completions`` with a
token-id prompt and ``return_token_ids``), so the next turn holds exactly the tokens the server produced.

For each configuration of ``--configs`` (serve.py's: ``ar``, ``mtp1`` .. ``mtp8``, ``bole`` and its variants,
with the same acceptance options), one at a time: start ``vllm.entrypoints.openai.api_server`` with
``--enable-prefix-caching --enable-prompt-tokens-details``, send ``--warmup-prompts`` unrelated conversations of
``--warmup-turns`` turns (Bole captures its CUDA graphs on first use: later turns' shapes need warming too), read
vLLM's prefix-cache counters from ``/metrics``, run the conversations, read the counters again, stop the server.

Recorded per configuration: the hit rate two ways (the share of prompt tokens served from the cache, from each
response's ``usage.prompt_tokens_details.cached_tokens``; and ``vllm:prefix_cache_hits`` over
``vllm:prefix_cache_queries``, which count lookups: a request that waits is looked up again), the hit rate of the
turns after the first, TTFT and TPOT p50 / p99 (streamed: TTFT to the first token, TPOT over the rest of a request),
output tok/s over the workload's wall time, tokens and draft nodes per request per step (vLLM's speculative-decoding
counters), the share of Bole's budgets its throughput rule chose (its per-interval log lines over the server's whole
run, warm-up included), and whether every request completed with all its tokens; and each
request's prompt length, cached tokens, TTFT and latency (``requests``). Printed: a
table per configuration and Bole's hit-rate difference against ``ar`` (points) and TTFT / TPOT ratios against the
best MTP chain. Output: ``--out`` (default ``benchmarks/results/prefix_cache.json``; ``--smoke``:
``$OUT/prefix-cache-smoke.json`` or ``/tmp/bole-prefix-cache-smoke/``). Exit status 1 when a server did not start
or a request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import serve  # noqa: E402
import soak  # noqa: E402
from e2e import DEFAULT_BUDGET_TABLE, is_bole, is_chain, parse_variant  # noqa: E402
from vllm_bole.spec_decode.synthetic import DEFAULT_RATES, DEFAULT_SIBLING_RATES  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks/results/prefix_cache.json"
COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:spec_decode_num_drafts",
            "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
WORKLOAD_KEYS = ("model", "conversations", "turns", "system_len", "first_len", "append_len", "output_len",
                 "max_concurrency", "acceptance", "rates", "sibling_rates", "max_model_len", "max_num_seqs",
                 "max_num_batched_tokens", "kv_cache_gib", "seed", "server_args")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="ar,mtp3,bole", help="serve.py's configuration names, comma-separated")
    p.add_argument("--variant", type=parse_variant, action="append", default=[], metavar="NAME=JSON",
                   help="a named Bole variant (as serve.py)")
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-len", type=int, default=1024, help="the system prompt every conversation shares")
    p.add_argument("--first-len", type=int, default=512, help="each conversation's own first message")
    p.add_argument("--append-len", type=int, default=256, help="tokens appended after each turn's output")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per turn")
    p.add_argument("--max-concurrency", type=int, default=0, help="conversations in flight (0: all)")
    p.add_argument("--warmup-prompts", type=int, default=8, help="unrelated requests before the measured run")
    p.add_argument("--warmup-turns", type=int, default=1,
                   help="turns of each warm-up conversation (more than 1: later turns hit the cache, so the shapes "
                        "of prefix-hit steps are compiled and captured before the measured run)")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="default: benchmarks/models/qwen3.5-9b-shape (dummy weights)")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--load-format", default=None)
    p.add_argument("--max-model-len", type=int, default=0, help="0: the longest conversation plus a margin")
    p.add_argument("--max-num-seqs", type=int, default=0)
    p.add_argument("--max-num-batched-tokens", type=int, default=0)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--kv-cache-gib", type=float, default=0.0)
    p.add_argument("--server-args", default="", help="more api_server arguments for every configuration")
    p.add_argument("--acceptance", choices=("synthetic", "real"), default="synthetic")
    p.add_argument("--rates", type=serve._floats, default=list(DEFAULT_RATES))
    p.add_argument("--sibling-rates", type=serve._floats, default=list(DEFAULT_SIBLING_RATES))
    p.add_argument("--draft-vocab-coverage", type=float, default=serve.DEFAULT_DRAFT_VOCAB_COVERAGE,
                   help="as serve.py's")
    p.add_argument("--budget-table", default=DEFAULT_BUDGET_TABLE)
    p.add_argument("--out", default=None)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--smoke", action="store_true",
                   help="CPU: the tiny Qwen3.5 built offline, ar and bole, 4 conversations of 3 turns")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="merge results of the same workload, one or more configurations each (runs one after the "
                        "other on one machine), into --out; runs nothing")
    return p


def apply_smoke(opts, given: set[str]) -> None:
    """The tiny Qwen3.5 on CPU (blocks of 128 tokens there), verified against the model: ar and bole (vLLM's MTP
    chain with prefix caching needs Triton, which vLLM's CPU build has not), about two minutes on two cores; options
    given on the command line win."""
    smoke = {"configs": "ar,bole", "conversations": 4, "turns": 3, "system_len": 256, "first_len": 40,
             "append_len": 40, "output_len": 32, "warmup_prompts": 2, "max_num_seqs": 8, "max_num_batched_tokens": 256,
             "acceptance": "real"}
    for key, value in smoke.items():
        if key not in given:
            setattr(opts, key, value)
    if opts.out is None:
        opts.out = str(Path(os.environ.get("OUT") or "/tmp/bole-prefix-cache-smoke") / "prefix-cache-smoke.json")


# --------------------------------------------------------------------------------------------------- workload

def _vocab(opts) -> tuple[int, set[int]]:
    """(vocabulary size, special token ids kept out of prompts) of the served model."""
    if opts.smoke and opts.model is None:
        from vllm_bole.testing.tiny_models import tiny_model_dir

        config = serve._model_config(tiny_model_dir("qwen3_5"))
    else:
        config = serve._model_config(opts.model)
    text = config.get("text_config", config)
    special = set()
    for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
        v = text.get(key)
        special |= set(v) if isinstance(v, list) else {v}
    for key in ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"):
        special.add(config.get(key))
    return int(text["vocab_size"]), {s for s in special if isinstance(s, int)}


def plan(opts, vocab: int, special: set[int], seed: int) -> tuple[list[int], list[list[list[int]]]]:
    """(the shared system prompt, per conversation its first message and the appends of its later turns)."""
    rng = random.Random(seed)
    # Token ids away from the specials (and, for word-level tokenizers, ids that decode to one word each).
    pool = [t for t in range(10, vocab) if t not in special]

    def tokens(n: int) -> list[int]:
        return [rng.choice(pool) for _ in range(n)]

    system = tokens(opts.system_len)
    convs = [[tokens(opts.first_len)] + [tokens(opts.append_len) for _ in range(opts.turns - 1)]
             for _ in range(opts.conversations)]
    return system, convs


def longest_context(opts) -> int:
    return opts.system_len + opts.first_len + (opts.turns - 1) * (opts.output_len + opts.append_len) + opts.output_len


# --------------------------------------------------------------------------------------------------- client

async def complete(session, base: str, model: str, prompt: list[int], max_tokens: int, timeout: float) -> dict:
    """One streamed greedy completion of a token-id prompt: its output token ids, TTFT, latency, cached tokens."""
    import aiohttp

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, ids, usage = None, [], None
    async with session.post(base + "/v1/completions", json=body,
                            timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        if r.status != 200:
            return {"error": f"HTTP {r.status}: {(await r.read()).decode(errors='replace')[:300]}"}
        try:
            async for chunk in soak.sse_events(r):
                usage = chunk.get("usage") or usage
                for c in chunk.get("choices") or ():
                    new = c.get("token_ids") or []
                    if new and ttft is None:
                        ttft = time.perf_counter() - t0
                    ids += new
        except RuntimeError as e:
            return {"error": str(e)}
    latency = time.perf_counter() - t0
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return {"ids": ids, "ttft": ttft, "latency": latency, "cached": cached,
            "prompt_tokens": (usage or {}).get("prompt_tokens")}


async def run_conversations(base: str, model: str, opts, system: list[int], convs: list[list[list[int]]]
                            ) -> list[dict]:
    """Every conversation turn by turn (all conversations concurrently, up to ``--max-concurrency``); one record
    per request."""
    import aiohttp

    records: list[dict] = []
    gate = asyncio.Semaphore(opts.max_concurrency or len(convs))

    async def conversation(i: int, session) -> None:
        async with gate:
            context = list(system)
            for turn, new in enumerate(convs[i]):
                context += new
                out = await complete(session, base, model, context, opts.output_len, opts.request_timeout)
                records.append({"conversation": i, "turn": turn, "prompt_len": len(context), **out})
                if "error" in out:
                    return
                context += out["ids"]

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(conversation(i, session) for i in range(len(convs))))
    return records


def read_counters(base: str) -> dict[str, float]:
    """vLLM's prefix-cache and speculative-decoding counters, summed over engines (0 where a server has none)."""
    status, body = soak._get(base + "/metrics", timeout=10)
    if status != 200:
        raise RuntimeError(f"/metrics answered {status}")
    sums = soak.metric_sums(body.decode(), [name + "_total" for name in COUNTERS])
    return {name: sums.get(name + "_total", 0.0) for name in COUNTERS}


# --------------------------------------------------------------------------------------------------- summary

def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, 100 * q)) if values else None


def _per(counters: dict[str, float], name: str) -> float:
    return counters[name] / counters["vllm:spec_decode_num_drafts"]


def summarize(name: str, records: list[dict], counters: dict[str, float], wall_s: float, opts) -> dict:
    ok = [r for r in records if "error" not in r]
    want = opts.conversations * opts.turns
    later = [r for r in ok if r["turn"] > 0]
    prompt = sum(r["prompt_len"] for r in ok)
    cached = sum(r["cached"] or 0 for r in ok)
    ttft = [r["ttft"] * 1e3 for r in ok if r["ttft"] is not None]
    tpot = [(r["latency"] - r["ttft"]) * 1e3 / (len(r["ids"]) - 1) for r in ok
            if r["ttft"] is not None and len(r["ids"]) > 1]
    later_ttft = [r["ttft"] * 1e3 for r in later if r["ttft"] is not None]
    drafts = counters["vllm:spec_decode_num_drafts"]
    row = {
        "config": name, "requests": want, "completed": len(ok), "failed": len(records) - len(ok),
        "missing": want - len(records),
        "complete_outputs": all(len(r["ids"]) == opts.output_len for r in ok),
        "prompt_tokens": prompt, "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else None,
        "hit_rate_later_turns": (sum(r["cached"] or 0 for r in later) / sum(r["prompt_len"] for r in later)
                                 if later else None),
        "prefix_cache_queries": counters["vllm:prefix_cache_queries"],
        "prefix_cache_hits": counters["vllm:prefix_cache_hits"],
        "counter_hit_rate": (counters["vllm:prefix_cache_hits"] / counters["vllm:prefix_cache_queries"]
                             if counters["vllm:prefix_cache_queries"] else None),
        "ttft_p50_ms": _pct(ttft, 0.5), "ttft_p99_ms": _pct(ttft, 0.99), "ttft_mean_ms": sum(ttft) / len(ttft)
        if ttft else None, "ttft_later_turns_p50_ms": _pct(later_ttft, 0.5),
        "tpot_p50_ms": _pct(tpot, 0.5), "tpot_p99_ms": _pct(tpot, 0.99),
        # vLLM counts a draft per request per step: tokens each request got per step (1 + accepted) and the draft
        # nodes it verified (a chain's k; Bole's share of the step's node budget)
        "tokens_per_step": 1 + _per(counters, "vllm:spec_decode_num_accepted_tokens") if drafts else 1.0,
        "nodes_per_request_step": _per(counters, "vllm:spec_decode_num_draft_tokens") if drafts else 0.0,
        "output_tok_s": sum(len(r["ids"]) for r in ok) / wall_s if wall_s else None,
        "wall_s": round(wall_s, 2),
        "errors": [r["error"] for r in records if "error" in r][:3],
    }
    row["ok"] = row["completed"] == want and row["complete_outputs"]
    return row


def same_outputs(a: list[dict], b: list[dict]) -> int:
    """How many conversations produced the same tokens in every turn under both configurations (``requests``
    records: by their outputs' digests)."""
    def by_conv(records):
        out: dict[int, list] = {}
        for r in records:
            out.setdefault(r["conversation"], []).append(r["output_sha1"])
        return out
    x, y = by_conv(a), by_conv(b)
    return sum(1 for c in x if x[c] == y.get(c))


def _output_digest(ids: list[int]) -> dict:
    """A request's output length and a digest of its tokens (to compare configurations without the tokens)."""
    return {"output_tokens": len(ids), "output_sha1": hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:16]}


def comparison(rows: list[dict]) -> dict:
    """Each Bole configuration's hit rate against ar's (points) and TTFT / TPOT p50 against the best chain's."""
    good = {r["config"]: r for r in rows if r["ok"]}
    chains = {n: r for n, r in good.items() if is_chain(n)}
    out: dict = {}
    best_tpot = min(chains.values(), key=lambda r: r["tpot_p50_ms"]) if chains else None
    best_ttft = min(chains.values(), key=lambda r: r["ttft_p50_ms"]) if chains else None
    for n, r in good.items():
        if n == "ar" or is_chain(n):
            continue
        c = {}
        if "ar" in good:
            c["hit_rate_points_vs_ar"] = 100 * (r["hit_rate"] - good["ar"]["hit_rate"])
        if best_tpot:
            c |= {"best_chain_tpot": best_tpot["config"], "tpot_ratio": r["tpot_p50_ms"] / best_tpot["tpot_p50_ms"],
                  "best_chain_ttft": best_ttft["config"], "ttft_ratio": r["ttft_p50_ms"] / best_ttft["ttft_p50_ms"],
                  "hit_rate_points_vs_best_chain": 100 * (r["hit_rate"] - max(x["hit_rate"] for x in chains.values()))}
        out[n] = c
    return out


def table(rows: list[dict]) -> str:
    def f(v, spec=".1f"):
        return "–" if v is None else format(v, spec)
    lines = ["| config | hit rate | later turns | vLLM counters | TTFT p50 / p99 ms | TPOT p50 / p99 ms | tok/s "
             "| tokens / nodes per request-step | ok |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {f(100 * r['hit_rate'] if r['hit_rate'] is not None else None)}% | "
                     f"{f(100 * r['hit_rate_later_turns'] if r['hit_rate_later_turns'] is not None else None)}% | "
                     f"{f(100 * r['counter_hit_rate'] if r['counter_hit_rate'] is not None else None)}% | "
                     f"{f(r['ttft_p50_ms'], '.0f')} / {f(r['ttft_p99_ms'], '.0f')} | "
                     f"{f(r['tpot_p50_ms'], '.2f')} / {f(r['tpot_p99_ms'], '.2f')} | {f(r['output_tok_s'])} | "
                     f"{f(r.get('tokens_per_step'), '.2f')} / {f(r.get('nodes_per_request_step'), '.1f')} | "
                     f"{'yes' if r['ok'] else 'NO'} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------- driver

def run_config(name: str, opts, model: str | None, shared: list[str], on_gpu: bool, log_dir: Path,
               work: tuple, warm: tuple) -> tuple[dict, list[dict]]:
    t0 = time.monotonic()
    entry, server, log = serve.start_config_server(name, opts, model, shared, on_gpu, log_dir)
    if server is None:
        return entry, []
    try:
        if opts.warmup_prompts:
            asyncio.run(run_conversations(server.base, server.model, *warm))
        before = read_counters(server.base)
        t = time.monotonic()
        records = asyncio.run(run_conversations(server.base, server.model, opts, *work))
        wall = time.monotonic() - t
        after = read_counters(server.base)
        entry["kv_cache_usage_after"] = soak.read_metrics(server.base).get("vllm:kv_cache_usage_perc")
    finally:
        server.stop()
        entry["budget_log"] = serve._budget_lines(log)
        entry["wall_s"] = round(time.monotonic() - t0, 1)
    row = summarize(name, records, {k: after[k] - before[k] for k in COUNTERS}, wall, opts)
    # the share of Bole's budgets its throughput rule chose, from the per-interval lines of the whole server run
    row["bole_budget_rule"] = serve.rule_share(log.read_text(errors="replace")) if log.exists() else None
    print(f"[{name}] {row['completed']}/{row['requests']} requests, hit rate {100 * (row['hit_rate'] or 0):.1f}% "
          f"(later turns {100 * (row['hit_rate_later_turns'] or 0):.1f}%), TTFT p50 {row['ttft_p50_ms'] or 0:.0f} ms, "
          f"TPOT p50 {row['tpot_p50_ms'] or 0:.2f} ms ({wall:.1f} s)", flush=True)
    return entry, [row, records]


def run(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    opts = parser.parse_args(argv)
    if opts.merge:   # runs nothing
        return merge(opts.merge, Path(opts.out or DEFAULT_OUT))
    if opts.smoke:
        apply_smoke(opts, serve.given_options(argv, parser))
    opts.max_model_len = opts.max_model_len or longest_context(opts) + 64
    import torch

    on_gpu = torch.cuda.is_available()
    names = serve._config_names(opts.configs, dict(opts.variant), inline=True)
    model, shared, _ = serve.model_setup(opts, on_gpu)
    shared = [f for f in shared if f != "--no-enable-prefix-caching"]
    shared += ["--enable-prefix-caching", "--enable-prompt-tokens-details"]
    vocab, special = _vocab(opts)
    work = plan(opts, vocab, special, opts.seed)
    # Warm-up: unrelated conversations (another system prompt), all at once.
    warm_opts = argparse.Namespace(**{**vars(opts), "conversations": opts.warmup_prompts,
                                      "turns": opts.warmup_turns,
                                      "max_concurrency": 0})
    warm = (warm_opts, *plan(warm_opts, vocab, special, opts.seed + 1))
    out = Path(opts.out or DEFAULT_OUT)
    log_dir = Path(opts.log_dir) if opts.log_dir else (
        Path(os.environ["OUT"]) / "prefix-cache-logs" if os.environ.get("OUT")
        else Path(tempfile.mkdtemp(prefix="bole-prefix-cache-")))
    log_dir.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python3", "benchmarks/prefix_cache.py", *argv])
    print(f"prefix_cache.py: {len(names)} configurations, {opts.conversations} conversations x {opts.turns} turns "
          f"(contexts up to {longest_context(opts)} tokens), logs in {log_dir}", flush=True)
    configs, rows, records = {}, [], {}
    for name in names:
        entry, got = run_config(name, opts, model, shared, on_gpu, log_dir, work, warm)
        configs[name] = entry
        if got:
            rows.append(got[0])
            records[name] = got[1]
    requests = {n: [{k: v for k, v in r.items() if k != "ids"} | _output_digest(r.get("ids") or [])
                    for r in sorted(recs, key=lambda r: (r["conversation"], r["turn"]))]
                for n, recs in records.items()}
    data = {
        "benchmark": "prefix caching (benchmarks/prefix_cache.py): multi-turn conversations, vLLM's OpenAI server",
        "ok": len(rows) == len(names) and all(r["ok"] for r in rows),
        "command": command, "run": time.strftime("%Y-%m-%dT%H:%M:%S"), "gpu": serve._gpu_name(on_gpu),
        "workload": {k: getattr(opts, k) for k in WORKLOAD_KEYS},
        "shared_server_flags": shared, "rows": rows, "configs": configs,
        "bole_configs": [n for n in names if is_bole(n, dict(opts.variant))],
        "requests": requests,
    }
    return finish(data, out)


def finish(data: dict, out: Path) -> dict:
    """Compare the rows (against ar's outputs and hit rate, and the best chain's times), write and print."""
    rows, requests = data["rows"], data["requests"]
    if "ar" in requests:   # greedy: with acceptance "real" every configuration should produce ar's tokens
        for r in rows:
            r["same_conversations_as_ar"] = same_outputs(requests["ar"], requests[r["config"]])
    data["comparison"] = comparison(rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1, default=str) + "\n")
    print()
    print(table(rows))
    for n, c in data["comparison"].items():
        print(f"{n}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in c.items()))
    print(f"prefix_cache.py: {'all complete' if data['ok'] else 'FAILED'}; wrote {out}", flush=True)
    return data


def merge(paths: list[str], out: Path) -> dict:
    """One result from several runs of the same workload and GPU (``--merge``): their rows, configurations and
    requests side by side, each run's command and time under ``runs``."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    first = parts[0]
    for key in ("workload", "gpu", "shared_server_flags"):
        differ = [p for d, p in zip(parts, paths) if d[key] != first[key]]
        if differ:
            raise SystemExit(f"--merge: {differ[0]} has another {key} than {paths[0]}")
    names = [r["config"] for d in parts for r in d["rows"]]
    if len(set(names)) < len(names):
        raise SystemExit(f"--merge: a configuration appears twice among {names}")
    data = {k: first[k] for k in ("benchmark", "gpu", "workload", "shared_server_flags")}
    data["ok"] = all(d["ok"] for d in parts)
    data["runs"] = [{"command": d["command"], "run": d["run"], "configs": list(d["configs"])} for d in parts]
    for key in ("rows", "bole_configs"):
        data[key] = [x for d in parts for x in d[key]]
    for key in ("configs", "requests"):
        data[key] = {n: v for d in parts for n, v in d[key].items()}
    return finish(data, out)


def main(argv: list[str] | None = None) -> int:
    soak.exit_on_sigterm()
    return 0 if run(argv)["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
