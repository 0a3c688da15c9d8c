"""Run one vLLM engine configuration on token-id prompts and write outputs, logprobs and counters as JSON.

    python -m vllm_bole.testing.engine_run --spec SPEC.json --out OUT.json

SPEC: {"model": dir, "kind": "qwen3_5", "engine": {LLM kwargs}, "requests": [{"prompt": [ids],
"max_tokens": n, "ignore_eos": bool, "temperature": t, "seed": s, "stop_token_ids": [ids], "top_k": k,
"top_p": p, "min_p": m, "presence_penalty", "frequency_penalty", "repetition_penalty", "allowed_token_ids",
"min_tokens", "bad_words": [strings], "logit_bias": {"id": bias}, "n", "prompt_logprobs", "structured": {vLLM
StructuredOutputsParams fields, e.g. "regex": "..."}, "images": [{"height": h, "width": w, "seed": s}]}],
"logprobs": 2, "cpu_async_scheduling": bool}; request keys other than "prompt" and "max_tokens" are optional
(vLLM's defaults, except ``ignore_eos`` true and ``temperature`` 0). ``images``: random-pixel images for the
prompt's image placeholders (a vision checkpoint, ``tiny_models`` kind ``qwen3_5_vision``). Each output also
carries the prompt's token ids as the engine saw them (``prompt_ids``: image placeholders expanded), every
choice's tokens (``choices``, for ``n`` > 1) and the prompt logprobs (``prompt_logprobs``: per prompt position
after the first, token id -> logprob).
``cpu_async_scheduling``: run vLLM's async scheduling on CPU (:func:`force_cpu_async_scheduling`). Each
configuration runs in its own process (tests start one per engine), so registries and caches never leak between
engines.
"""

import argparse
import faulthandler
import json
import os
import signal
import statistics
import time


def _runner(llm):
    from vllm_bole._vllm_compat import model_runner_of

    try:
        return model_runner_of(llm)
    except AttributeError:
        return None


def _budget(llm, name: str):
    """An attribute of the Bole runner's budget policy (``worker/budget_policy.BudgetPolicy``); None without Bole."""
    return getattr(getattr(_runner(llm), "bole_budget", None), name, None)


def graph_summary(llm) -> dict | None:
    """Bole's full CUDA graphs (GPU): verification graphs, drafter level graphs and the device-grown levels'
    whole-level graphs captured, and replays."""
    runner = _runner(llm)
    graphs = getattr(runner, "_bole_graphs", None)
    if graphs is None:
        return None
    summary = {"graphs": len(graphs.graphs), "replays": graphs.replays, "stand_in_replays": graphs.stand_ins.replays}
    draft = getattr(getattr(runner, "bole_drafter", None), "graphs", None)
    if draft is not None:
        summary |= {"draft_graphs": len(draft.graphs), "draft_replays": draft.replays,
                    "draft_stand_in_replays": draft.stand_ins.replays}
    drafter = getattr(runner, "bole_drafter", None)
    beams = [b.graphs for b in drafter.beams() if b.graphs is not None] if drafter is not None else []
    if beams:   # (the full beam's and the chains')
        summary |= {"beam_graphs": sum(len(b.graphs) for b in beams), "beam_replays": sum(b.replays for b in beams)}
    return summary


def _beam_levels(llm) -> int | None:
    """Tree levels the MTP drafter grew on the device (None: it grows them on the host, or another drafter)."""
    drafter = getattr(_runner(llm), "bole_drafter", None)
    beams = drafter.beams() if drafter is not None else []
    return sum(b.levels_run for b in beams) if beams else None


def _chain_levels(llm) -> int | None:
    """Of those, the levels of one-wide steps (chains; None: none ran)."""
    chain = getattr(getattr(_runner(llm), "bole_drafter", None), "chain", None)
    return None if chain is None else chain.levels_run


def _draft_vocab(llm):
    """The MTP drafter's draft vocabulary (None: the full vocabulary, or another drafter)."""
    return getattr(getattr(_runner(llm), "bole_drafter", None), "draft_vocab", None)


def _profiled_steps(llm) -> int | None:
    profiler = getattr(_runner(llm), "_bole_profiler", None)
    return None if profiler is None else sum(profiler.steps.values())


def _verified_trees(llm) -> list[list[int]] | None:
    """The drafted tokens of every tree the walks saw, in step order (``VLLM_BOLE_RECORD_WALKS=1``; None without
    the record)."""
    log = getattr(_runner(llm), "bole_walk_log", None)
    return None if log is None else [list(w.tokens[1:]) for w in log.walks]


def _draft_vocab_ids(llm) -> list[int] | None:
    """Token ids the MTP drafter may propose (None: the full vocabulary, or another drafter)."""
    vocab = _draft_vocab(llm)
    return None if vocab is None else vocab.ids.tolist()


def _mamba_state_summary(llm) -> list[dict]:
    """Per Mamba KV-cache group: state shapes and how many slots a request holds (in-process engines only)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    runner = _runner(llm)
    if runner is None:
        return []
    return [{"shapes": [list(s) for s in g.kv_cache_spec.shapes],
             "num_speculative_blocks": g.kv_cache_spec.num_speculative_blocks,
             "runner": type(runner).__name__}
            for g in runner.kv_cache_config.kv_cache_groups if isinstance(g.kv_cache_spec, MambaSpec)]


_OPTIONAL_SAMPLING = ("top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                      "allowed_token_ids", "min_tokens", "bad_words", "n", "prompt_logprobs")


def _sampling_params(sampling_params_cls, r: dict, logprobs):
    extra = {key: r[key] for key in _OPTIONAL_SAMPLING if key in r}
    if "logit_bias" in r:   # JSON object keys are strings
        extra["logit_bias"] = {int(token): bias for token, bias in r["logit_bias"].items()}
    if "structured" in r:
        from vllm.sampling_params import StructuredOutputsParams

        extra["structured_outputs"] = StructuredOutputsParams(**r["structured"])
    return sampling_params_cls(max_tokens=r["max_tokens"], ignore_eos=r.get("ignore_eos", True),
                               temperature=r.get("temperature", 0.0), seed=r.get("seed"),
                               stop_token_ids=r.get("stop_token_ids"), logprobs=logprobs, **extra)


def _image(height: int, width: int, seed: int):
    """An RGB image of uniformly random pixels, the same for the same arguments."""
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def _prompt(r: dict) -> dict:
    prompt = {"prompt_token_ids": r["prompt"]}
    if r.get("images"):
        prompt["multi_modal_data"] = {"image": [_image(**i) for i in r["images"]]}
    return prompt


def force_cpu_async_scheduling() -> None:
    """Keep ``async_scheduling`` on for CPU engines built after this call (in this process). vLLM 0.26's CPU
    platform turns it off unconditionally (``CpuPlatform.check_and_update_config``), yet the engine's batch
    queue, the AsyncScheduler and the runner's async output and spec-decode paths run on CPU (the CPU worker
    stands in for CUDA events and streams): a test harness for async scheduling without a GPU."""
    from vllm.platforms.cpu import CpuPlatform

    check = CpuPlatform.check_and_update_config.__func__
    if getattr(check, "_keeps_async", False):
        return

    def keep_async(cls, vllm_config) -> None:
        wanted = vllm_config.scheduler_config.async_scheduling
        check(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = wanted

    keep_async._keeps_async = True
    CpuPlatform.check_and_update_config = classmethod(keep_async)


def _preemptions(llm) -> int:
    """Requests vLLM preempted (KV cache full) over the run."""
    return int(sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"))


def _scheduling(llm) -> dict:
    """Whether the engine really scheduled asynchronously: its config flag, the engine core's batch queue and the
    scheduler class."""
    from vllm_bole._vllm_compat import engine_core_of

    core = engine_core_of(llm)
    return {"async_scheduling": bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling),
            "batch_queue": getattr(core, "batch_queue", None) is not None,
            "scheduler": type(core.scheduler).__name__}


def _budget_log(llm) -> dict | None:
    """The Bole scheduler's budget counts since the start (``BudgetLog.totals``: steps, how many the throughput
    rule chose, nodes, request-steps); None without them."""
    from vllm_bole._vllm_compat import engine_core_of

    log = getattr(engine_core_of(llm).scheduler, "_budget_log", None)
    return None if log is None else dict(log.totals)


def same_cpu_attention_as_bole() -> None:
    """On CPUs with AMX vLLM's attention runs its AMX kernel, whose blocked cache layout Bole's tree rows cannot
    read, so Bole's layers run the plain-layout kernel there (``attention/tree_attn_cpu.py``). Engines built after
    this call (in this process) run that kernel too, so that a reference and a Bole run differ by nothing but Bole:
    the two kernels' bf16 roundings moved the tiny models' logprobs by 2e-2, the size of the faults the logprob
    checks look for (``tests/e2e_support.py``)."""
    from vllm_bole._vllm_compat import plain_layout_cpu_attention
    from vllm_bole.attention.tree_attn_cpu import plain_layout_isa

    plain_layout_cpu_attention(plain_layout_isa)


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    from vllm_bole.testing.greedy_check import spec_decode_counters
    from vllm_bole.testing.tiny_models import engine_kwargs

    if spec.get("cpu_async_scheduling"):
        force_cpu_async_scheduling()
    same_cpu_attention_as_bole()
    llm = LLM(model=spec["model"], disable_log_stats=False,
              **(engine_kwargs(spec.get("kind", "qwen3_5")) | spec.get("engine", {})))
    params = [_sampling_params(SamplingParams, r, spec.get("logprobs")) for r in spec["requests"]]
    prompts = [_prompt(r) for r in spec["requests"]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    counters = spec_decode_counters(llm.get_metrics())
    timed = _timed(llm, prompts, params, spec.get("timed", 0))
    results = []
    for o in outs:
        c = o.outputs[0]
        top = [{int(t): lp.logprob for t, lp in step.items()} for step in (c.logprobs or [])]
        prompt_top = [{int(t): lp.logprob for t, lp in step.items()} for step in (o.prompt_logprobs or [])[1:]]
        results.append({"tokens": list(c.token_ids), "finish_reason": c.finish_reason, "logprobs": top,
                        "prompt_ids": list(o.prompt_token_ids), "choices": [list(x.token_ids) for x in o.outputs],
                        "prompt_logprobs": prompt_top, "cached_tokens": o.num_cached_tokens})
    return {"outputs": results, "counters": counters, **({"timed": timed} if timed else {}),
            "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
            "mamba_state": _mamba_state_summary(llm), "bole_graphs": graph_summary(llm),
            "device_levels": _beam_levels(llm), "chain_levels": _chain_levels(llm),
            "draft_vocab": _draft_vocab_ids(llm), "verified_trees": _verified_trees(llm),
            "draft_vocab_refreshes": getattr(_draft_vocab(llm), "refreshes", None),
            **step_counts(llm),
            "acceptance_steps": getattr(_budget(llm, "acceptance"), "steps", None),
            # tree steps the phase timer counted, of every kind (VLLM_BOLE_PROFILE_STEPS)
            "profiled_steps": _profiled_steps(llm),
            "budgets": _counts(_budget(llm, "planned")),
            "async_budgets": _counts(_budget(llm, "async_planned")),
            "scheduling": _scheduling(llm), "budget_log": _budget_log(llm), "preemptions": _preemptions(llm)}


def _timed(llm, prompts, params, runs: int) -> dict | None:
    """``runs`` more generates of the same requests after the first (which compiled and captured what they need),
    each timed: their wall seconds and output tokens per second (the median run's). The counters of the result are
    the first generate's."""
    if not runs:
        return None
    seconds, tokens = [], 0
    for _ in range(runs):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"runs_s": [round(s, 4) for s in seconds], "output_tokens": tokens,
            "tok_s": round(tokens / statistics.median(seconds), 1)}


def step_counts(llm) -> dict:
    """Bole's step counters (worker/model_runner.step_counts) of the first rank; every value None without Bole."""
    from vllm_bole.plugin import is_bole_engine
    from vllm_bole.worker.model_runner import STEP_COUNTS

    if not is_bole_engine(llm.llm_engine.vllm_config):
        return dict.fromkeys(STEP_COUNTS)
    return llm.collective_rpc("bole_step_counts")[0]


def _counts(counter) -> list | None:
    """A Counter of (batch size, budget) as sorted [batch size, budget, steps] rows (JSON has no tuple keys)."""
    return None if counter is None else sorted([b, n, c] for (b, n), c in counter.items())


def spec_cli(run_spec, description: str) -> None:
    """``--spec SPEC.json --out OUT.json``: ``run_spec(spec)`` in this process, on CPU with the test settings (offline,
    a 1 GiB KV cache, the engine core in this process), its result written as JSON."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # A caller that gives up on this run sends SIGUSR1 first: every thread's stack goes to stderr, where it hung.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    with open(args.spec) as f:
        spec = json.load(f)
    result = run_spec(spec)
    with open(args.out, "w") as f:
        json.dump(result, f)


def main() -> None:
    spec_cli(run, __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
