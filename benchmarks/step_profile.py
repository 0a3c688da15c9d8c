"""Where a Bole step's time goes at real shapes: one engine, several batch sizes, phase times per tree step.

    python benchmarks/step_profile.py [--model DIR] [--batch 1 16] [--spec '{"method": "bole", ...}']

Runs token-id prompts with dummy weights (``load_format="dummy"``) and synthetic acceptance in an in-process
engine, per batch size once plainly (tokens/s, mean accepted tokens per step) and, for Bole, once more with the
runner's step profiler on (see ``vllm_bole/worker/step_profile.py``), whose log lines give the mean time of
each phase (inputs + target forward, tree walk, commit + KV compaction, drafting). ``--arrivals N`` adds N
long-prompt requests while the batch decodes, so that mixed steps (prefill chunks beside trees) are measured
and traced too. Other specs (e.g.
``'{"method": "mtp", ...}'`` or ``none``) get the plain pass only. Appends rows to
``benchmarks/results/step_profile.json``.
"""

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "step_profile.json"
MODEL = Path(__file__).resolve().parent / "models" / "qwen3.5-9b-shape"   # config only: dummy weights
DEFAULT_SPEC = {"method": "bole", "num_speculative_tokens": 8, "topk": 4, "synthetic_acceptance": True}


@dataclasses.dataclass(frozen=True)
class Arrivals:
    """``--arrivals``: ``count`` more requests of ``prompt_len``-token prompts, one before every ``every``-th engine
    step from step ``every`` on, while the batch decodes: their prefills run beside the batch's trees (mixed
    steps), as new requests do when a server is under load."""

    count: int
    prompt_len: int
    every: int

    def at(self, step: int) -> int | None:
        """The arrival that comes before engine step ``step``, if any."""
        i, late = divmod(step, self.every)
        return i - 1 if not late and 1 <= i <= self.count else None


def _generate(llm, batch: int, prompt_len: int, new_tokens: int, seed: int, on_step=None,
              arrivals: Arrivals | None = None):
    """(new tokens, seconds) of one batch of random token-id prompts, the arrivals' tokens included. ``on_step(i)``:
    called before engine step ``i`` (the engine is then stepped here, not by ``llm.generate``, as with
    ``arrivals``), e.g. to start a profiler after the prefill."""
    import random

    from vllm import SamplingParams

    rng = random.Random(seed)
    try:   # ids clear of the special ones at the vocabulary's start, within a small model's vocabulary too
        high = min(200000, llm.llm_engine.model_config.get_vocab_size())
    except AttributeError:   # (a stand-in engine)
        high = 200000

    def prompt(n):
        return {"prompt_token_ids": [rng.randrange(min(1000, high // 2), high) for _ in range(n)]}

    prompts = [prompt(prompt_len) for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    if on_step is None and arrivals is None:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - start
    engine, tokens, step = llm.llm_engine, {}, 0
    for i, p in enumerate(prompts):
        engine.add_request(f"profiled-{seed}-{i}", p, params)
    while engine.has_unfinished_requests() or (arrivals is not None and step <= arrivals.count * arrivals.every):
        late = arrivals.at(step) if arrivals is not None else None
        if late is not None:
            engine.add_request(f"arrival-{seed}-{late}", prompt(arrivals.prompt_len), params)
        if on_step is not None:
            on_step(step)
        for out in engine.step():
            tokens[out.request_id] = len(out.outputs[0].token_ids)
        step += 1
    return sum(tokens.values()), time.perf_counter() - start


def _gpu_busy_ms(prof) -> float:
    """Time some kernel ran on the GPU (the union of device event intervals), in ms."""
    import torch

    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy / 1e3


def _arrivals(args) -> Arrivals | None:
    return Arrivals(args.arrivals, args.arrival_len, args.arrive_every) if args.arrivals else None


def _set_first_pass(runner, mode: str | None) -> None:
    """Drafting before the walk on or off between generate calls (``--first-pass``); None: leave it."""
    if mode is not None:
        runner._bole_early_drafting = mode == "on"
        runner._bole_draft_before_walk = True


def _torch_profile(llm, batch: int, args, out_dir: Path, tag: str) -> dict:
    """Op tables (device time and host time) of one generate call under torch.profiler, and how much of its
    wall time the GPU was busy (low: the step waits on the host)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    started = {}

    def on_step(i: int) -> None:   # the decode steps only: the prefill's kernels would blur the op table
        if i == args.profile_skip_steps:
            torch.cuda.synchronize()
            prof.start()
            started["t"] = time.perf_counter()

    _generate(llm, batch, args.prompt_len, 64, seed=batch + 1, on_step=on_step, arrivals=_arrivals(args))
    torch.cuda.synchronize()
    if not started:
        raise SystemExit(f"--profile-skip-steps {args.profile_skip_steps}: B={batch} finished before that step")
    elapsed = time.perf_counter() - started["t"]
    prof.stop()
    busy = _gpu_busy_ms(prof)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = prof.key_averages()
    head = (f"B={tag}: 64 new tokens (profiled from engine step {args.profile_skip_steps}), wall "
            f"{elapsed * 1e3:.1f} ms under the profiler, GPU busy {busy:.1f} ms ({100 * busy / (elapsed * 1e3):.0f}%)\n\n")
    text = (head + table.table(sort_by="self_cuda_time_total", row_limit=50) + "\n\n"
            + table.table(sort_by="self_cpu_time_total", row_limit=40))
    (out_dir / f"ops_B{tag}.txt").write_text(text)
    print(head.strip(), flush=True)
    if args.trace:   # the timeline, and where the GPU waited on the host (benchmarks/trace_gaps.py)
        import gzip
        import shutil

        import trace_gaps

        raw = out_dir / f"trace_B{tag}.json"
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
        events = trace_gaps.load(Path(f"{raw}.gz"))
        gaps = trace_gaps.report(trace_gaps.analyze(events), f"B={tag}: ")
        # Per-step lines too: a step that captured a graph or compiled a kernel stands out from the steady ones.
        (out_dir / f"gaps_B{tag}.txt").write_text(gaps + "\n\n" + "\n".join(trace_gaps.step_lines(events)) + "\n")
        print(gaps, flush=True)
    return {"profiled_wall_ms": round(elapsed * 1e3, 1), "profiled_gpu_busy_ms": round(busy, 1)}


def _scope_engine(llm) -> None:
    """Profiling scopes around the in-process engine's own steps (schedule, execute, output processing), so the
    trace shows the whole loop and not only the runner's phases."""
    from torch.profiler import record_function

    from vllm_bole._vllm_compat import engine_core_of

    core = engine_core_of(llm)

    def wrap(obj, name: str, label: str) -> None:
        fn = getattr(obj, name)

        def scoped(*a, **k):
            with record_function(label):
                return fn(*a, **k)

        setattr(obj, name, scoped)

    wrap(core.scheduler, "schedule", "engine: schedule")
    wrap(core.scheduler, "update_from_output", "engine: update_from_output")
    wrap(core.model_executor, "execute_model", "engine: execute_model")
    wrap(core.model_executor, "sample_tokens", "engine: sample_tokens")
    wrap(core.model_executor, "take_draft_token_ids", "engine: take_draft_token_ids")
    wrap(llm.llm_engine.output_processor, "process_outputs", "frontend: process_outputs")


def _host_profile(llm, batch: int, args, out_dir: Path, tag: str) -> None:
    """Python host time of one generate call under cProfile (the engine runs in this process): which calls
    keep the GPU waiting when the step is host-bound."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    _generate(llm, batch, args.prompt_len, args.host_profile_tokens or args.new_tokens, seed=batch + 2,
              arrivals=_arrivals(args))
    prof.disable()
    out_dir.mkdir(parents=True, exist_ok=True)
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("cumulative").print_stats(120)
    stats.sort_stats("tottime").print_stats(80)
    (out_dir / f"host_B{tag}.txt").write_text(text.getvalue())


def _host_audit(llm, batch: int, args, out_dir: Path, tag: str) -> None:
    """Host wall time per step of the engine's and runner's phases, and where the host waited for the GPU
    (``host_audit.py``), over one generate call at the measured length."""
    import host_audit

    if not hasattr(llm, "_host_audit"):
        llm._host_audit = (host_audit.HostTimer(), host_audit.SyncAudit())
        host_audit.time_engine(llm, llm._host_audit[0])
    timer, syncs = llm._host_audit
    timer.reset()
    timer.on = True
    syncs.start()
    tokens, elapsed = _generate(llm, batch, args.prompt_len, args.new_tokens, seed=batch + 3, arrivals=_arrivals(args))
    syncs.stop()
    timer.on = False
    steps = timer.calls["engine: execute_model"]
    head = (f"B={tag}: {tokens} tokens in {elapsed * 1e3:.1f} ms with the audit on, {steps} steps, "
            f"{elapsed * 1e3 / max(steps, 1):.2f} ms/step")
    text = head + "\n\n" + timer.report(f"B={tag}", "engine: execute_model") + "\n\n" + syncs.report(f"B={tag}", steps)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"hostaudit_B{tag}.txt").write_text(text + "\n")
    print(text, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(MODEL))
    parser.add_argument("--spec", default=json.dumps(DEFAULT_SPEC), help="speculative_config JSON ('none': AR)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--warmup-passes", type=int, default=2, help="warm-up generates per batch size")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--torch-profile", metavar="DIR",
                        help="also run each batch under torch.profiler and write op tables to DIR")
    parser.add_argument("--profile-skip-steps", type=int, default=2,
                        help="with --torch-profile: engine steps before the profiler starts (the prefill's)")
    parser.add_argument("--turn-lock", metavar="FILE",
                        help="take this file's lock once the engine is up and keep it to the end: several step_profile "
                             "processes (e.g. Bole and MTP) start their engines side by side and measure in turn")
    parser.add_argument("--trace", action="store_true",
                        help="with --torch-profile: also write the chrome trace (trace_B<b>.json.gz) with vLLM's and "
                             "Bole's profiling scopes, and the GPU's idle time by host scope (gaps_B<b>.txt)")
    parser.add_argument("--first-pass", choices=["config", "off", "on", "both"], default="config",
                        help="Bole: drafting before the walk (speculative_config.early_drafting) off, on, or both side "
                             "by side in the same engine (default: as the configuration sets it, on)")
    parser.add_argument("--host-profile", metavar="DIR",
                        help="also run each batch under cProfile and write the host call tables to DIR")
    parser.add_argument("--host-profile-tokens", type=int, default=0,
                        help="new tokens per request of the cProfile pass (default: --new-tokens, so that the "
                             "steady state outweighs the prefill)")
    parser.add_argument("--host-audit", metavar="DIR",
                        help="also run each batch with host timers and a GPU-wait audit (benchmarks/host_audit.py, no "
                             "profiler) and write hostaudit_B<b>.txt to DIR")
    parser.add_argument("--arrivals", type=int, default=0,
                        help="more requests arriving while the batch decodes, one every --arrive-every engine steps: "
                             "their prefills run beside the batch's trees (mixed steps; the step profiler and the "
                             "traces then show those too)")
    parser.add_argument("--arrival-len", type=int, default=1024, help="prompt tokens of each arrival")
    parser.add_argument("--arrive-every", type=int, default=4, help="engine steps between arrivals")
    parser.add_argument("--engine", default="{}",
                        help='more LLM keyword arguments as JSON, e.g. \'{"async_scheduling": false}\' (Bole '
                             'schedules asynchronously by default on a GPU)')
    args = parser.parse_args()
    spec = None if args.spec == "none" else json.loads(args.spec)
    bole = spec is not None and spec.get("method") == "bole"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the runner is reached in-process
    if args.trace:
        if not args.torch_profile:
            parser.error("--trace needs --torch-profile DIR")
        os.environ["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"   # vLLM's runner scopes (and Bole's) in the trace

    from vllm import LLM

    from vllm_bole._vllm_compat import model_runner_of
    from vllm_bole.testing.greedy_check import spec_decode_counters
    from vllm_bole.worker.step_profile import StepProfiler

    max_batch = max(args.batch)
    llm = LLM(model=args.model, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              limit_mm_per_prompt={"image": 0, "video": 0}, additional_config={"gdn_prefill_backend": "triton"},
              max_model_len=max(args.prompt_len, args.arrival_len if args.arrivals else 0) + args.new_tokens + 64,
              max_num_seqs=max_batch + args.arrivals,
              gpu_memory_utilization=args.gpu_memory_utilization, disable_log_stats=False,
              # Tree steps carry B + (up to the budget) tokens: capture sizes over that range, as benchmarks/e2e.py.
              compilation_config={"cudagraph_capture_sizes": sorted({1, 2, 4, *range(8, 256, 8), *range(256, 513, 32)}
                                                                      | set(args.batch))},
              speculative_config=spec, **json.loads(args.engine))
    runner = model_runner_of(llm)
    if args.turn_lock:   # held until the process exits
        import fcntl

        lock = open(args.turn_lock, "a")
        fcntl.flock(lock, fcntl.LOCK_EX)
        print(f"took {args.turn_lock}", flush=True)
    modes = [None]
    if bole and args.first_pass != "config":
        modes = ["off", "on"] if args.first_pass == "both" else [args.first_pass]
    # Warm-up: every batch size (and mode) at the measured length, so that Triton's compilations and Bole's lazy
    # graph captures (one per new step shape) stay out of the numbers and the traces.
    for batch in args.batch:
        for mode in modes:
            _set_first_pass(runner, mode)
            for _ in range(args.warmup_passes):
                _generate(llm, batch, args.prompt_len, args.new_tokens, seed=0, arrivals=_arrivals(args))
    if args.trace:
        _scope_engine(llm)
    rows = []
    for batch, mode in [(b, m) for b in args.batch for m in modes]:
        _set_first_pass(runner, mode)
        if bole and not runner._bole_early_drafting:   # the step profiler times the phases of drafting after the walk
            runner._bole_profiler = StepProfiler(args.profile_steps)
            print(f"B={batch}: profiled pass", flush=True)
            _generate(llm, batch, args.prompt_len, args.new_tokens, seed=batch, arrivals=_arrivals(args))
            runner._bole_profiler = None
        before = spec_decode_counters(llm.get_metrics()) if spec else None
        early_before = getattr(runner, "bole_early_draft_steps", 0)
        tokens, elapsed = _generate(llm, batch, args.prompt_len, args.new_tokens, seed=batch, arrivals=_arrivals(args))
        row = {"B": batch, "spec": spec, "tok_s": tokens / elapsed, "seconds": elapsed,
               "arrivals": dataclasses.asdict(_arrivals(args)) if args.arrivals else None}
        if bole:   # how many steps really drafted before the walk (it turns off after a failure)
            row |= {"first_pass": mode or ("on" if runner._bole_early_drafting else "off"),
                    "early_draft_steps": runner.bole_early_draft_steps - early_before}
        if spec:
            after = spec_decode_counters(llm.get_metrics())
            drafts = after["num_drafts"] - before["num_drafts"]
            accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
            row["mean_accepted"] = 1 + accepted / max(drafts, 1)
            row["draft_tokens_per_step"] = (after["num_draft_tokens"] - before["num_draft_tokens"]) / max(drafts, 1)
        rows.append(row)
        tag = f"{batch}" if mode is None else f"{batch}_{mode}"
        if args.torch_profile:
            row |= _torch_profile(llm, batch, args, Path(args.torch_profile), tag)
        if args.host_audit:
            _host_audit(llm, batch, args, Path(args.host_audit), tag)
        if args.host_profile:
            _host_profile(llm, batch, args, Path(args.host_profile), tag)
        label = f"B={batch}" if mode is None else f"B={batch} first pass {mode}"
        print(f"{label}: {row['tok_s']:.1f} tok/s" + (
            f", mean accepted {row['mean_accepted']:.2f}, nodes/step {row['draft_tokens_per_step']:.1f}"
            if spec else "") + (f", {row['early_draft_steps']} steps drafted before the walk"
                                   if bole else ""), flush=True)
    RESULTS.parent.mkdir(exist_ok=True)
    old = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    RESULTS.write_text(json.dumps(old + rows, indent=1))


if __name__ == "__main__":
    main()
