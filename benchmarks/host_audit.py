"""Host-side audits of an in-process engine, without torch.profiler's own overhead (``step_profile.py``):

- :class:`HostTimer`: wall time of chosen host functions (inclusive, and self: minus the timed functions they
  call), per engine step, from ``time.perf_counter``;
- :class:`SyncAudit`: every point where the host waited for the GPU: explicit ``synchronize`` calls of events,
  streams and the device (with the time each waited) and the implicit ones torch reports under
  ``torch.cuda.set_sync_debug_mode("warn")`` (``.item()``, ``.tolist()``, copies to pageable memory, ...), by
  call site.

A step is host-bound when its timed functions add up to more than its GPU time; a wait that drains the queue
(the GPU idles until the host launches again) shows up as a long synchronize.
"""

import collections
import time
import traceback
import warnings

import torch

_ROOTS = ("vllm_bole/", "vllm/", "benchmarks/")


def _site(stack, depth: int = 4) -> str:
    """The innermost ``depth`` frames of ``stack`` in vLLM, Bole or the benchmarks, innermost last."""
    frames = [f for f in stack if any(r in f.filename for r in _ROOTS) and "host_audit.py" not in f.filename]
    return " <- ".join(f"{f.filename.split('site-packages/')[-1].split('/work/main/')[-1]}:{f.lineno}({f.name})"
                       for f in reversed(frames[-depth:]))


class HostTimer:
    """``wrap(obj, name, label)`` times ``obj.name`` from then on; :meth:`report` per step (``per`` calls of the
    step label). Self time subtracts the timed functions called inside."""

    def __init__(self):
        self.total = collections.defaultdict(float)
        self.self_time = collections.defaultdict(float)
        self.calls = collections.Counter()
        self._stack: list[list] = []
        self.on = False

    def wrap(self, obj, name: str, label: str) -> None:
        fn = getattr(obj, name, None)
        if fn is None:
            return
        timer = self

        def timed(*a, **k):
            if not timer.on:
                return fn(*a, **k)
            frame = [label, 0.0]
            timer._stack.append(frame)
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent = time.perf_counter() - start
                timer._stack.pop()
                timer.total[label] += spent
                timer.self_time[label] += spent - frame[1]
                timer.calls[label] += 1
                if timer._stack:
                    timer._stack[-1][1] += spent

        setattr(obj, name, timed)

    def reset(self) -> None:
        self.total.clear()
        self.self_time.clear()
        self.calls.clear()

    def report(self, title: str, step_label: str) -> str:
        steps = max(self.calls[step_label], 1)
        lines = [f"{title}: {steps} steps ({step_label} calls); ms per step", "",
                 "| function | inclusive | self | calls/step |", "|---|---|---|---|"]
        for label in sorted(self.total, key=lambda x: -self.total[x]):
            lines.append(f"| {label} | {1e3 * self.total[label] / steps:.3f} | "
                         f"{1e3 * self.self_time[label] / steps:.3f} | {self.calls[label] / steps:.2f} |")
        return "\n".join(lines)


class SyncAudit:
    """Where the host waits for the GPU, by call site: count and total wait (explicit synchronizes) or count
    (torch's sync warnings, whose wait is not timed)."""

    def __init__(self):
        self.waits = collections.defaultdict(lambda: [0, 0.0])
        self.implicit = collections.Counter()
        self.on = False
        self._patch()

    def _patch(self) -> None:
        audit = self

        def timed_sync(original, kind):
            def sync(*a, **k):
                if not audit.on:
                    return original(*a, **k)
                start = time.perf_counter()
                try:
                    return original(*a, **k)
                finally:
                    entry = audit.waits[f"{kind} @ {_site(traceback.extract_stack()[:-1])}"]
                    entry[0] += 1
                    entry[1] += time.perf_counter() - start
            return sync

        torch.cuda.Event.synchronize = timed_sync(torch.cuda.Event.synchronize, "event.synchronize")
        torch.cuda.Stream.synchronize = timed_sync(torch.cuda.Stream.synchronize, "stream.synchronize")
        torch.cuda.synchronize = timed_sync(torch.cuda.synchronize, "cuda.synchronize")
        shown = warnings.showwarning

        def showwarning(message, category, filename, lineno, file=None, line=None):
            if audit.on and "synchronizing" in str(message):
                audit.implicit[_site(traceback.extract_stack()[:-1])] += 1
                return
            shown(message, category, filename, lineno, file, line)

        warnings.showwarning = showwarning

    def start(self) -> None:
        self.waits.clear()
        self.implicit.clear()
        self.on = True
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self.on = False

    def report(self, title: str, steps: int) -> str:
        steps = max(steps, 1)
        lines = [f"{title}: host waits over {steps} steps", "",
                 "| explicit synchronize @ call site | calls/step | ms/step |", "|---|---|---|"]
        for site, (n, t) in sorted(self.waits.items(), key=lambda x: -x[1][1]):
            lines.append(f"| {site} | {n / steps:.2f} | {1e3 * t / steps:.3f} |")
        lines += ["", "| implicit sync (torch sync debug mode) @ call site | calls/step |", "|---|---|"]
        for site, n in self.implicit.most_common():
            lines.append(f"| {site} | {n / steps:.2f} |")
        return "\n".join(lines)


def time_engine(llm, timer: HostTimer) -> None:
    """Wrap the engine loop's and the runner's host phases (vLLM's and Bole's) in ``timer``."""
    from vllm.v1.worker import gpu_model_runner as gmr

    from vllm_bole._vllm_compat import engine_core_of, model_runner_of
    from vllm_bole.attention import gdn
    from vllm_bole.spec_decode import beam_graphs, device_beam, mtp_tree_drafter
    from vllm_bole.worker import commit, early_drafting, verify_graphs

    core = engine_core_of(llm)
    runner = model_runner_of(llm)
    for obj, name, label in [
        (core, "step_fn", "engine: step"),
        (core.scheduler, "schedule", "engine: schedule"),
        (core.scheduler, "update_from_output", "engine: update_from_output"),
        (core.model_executor, "execute_model", "engine: execute_model"),
        (core.model_executor, "sample_tokens", "engine: sample_tokens"),
        (llm.llm_engine.output_processor, "process_outputs", "frontend: process_outputs"),
        (gmr.AsyncGPUModelRunnerOutput, "get_output", "runner: AsyncGPUModelRunnerOutput.get_output"),
        (runner, "_update_states", "runner: _update_states"),
        (runner, "_prepare_inputs", "runner: _prepare_inputs (Bole's, with vLLM's)"),
        (runner.bole_forest_builder, "build", "bole: ForestBuilder.build"),
        (runner.bole_forest_builder, "_write_queued", "bole: ForestBuilder._write_queued"),
        (runner, "_build_attention_metadata", "runner: _build_attention_metadata"),
        (runner, "_preprocess", "runner: _preprocess"),
        (runner, "_model_forward", "runner: _model_forward"),
        (runner, "sample_tokens", "runner: sample_tokens"),
        (runner, "_sample", "runner: _sample"),
        (runner, "_bookkeeping_sync", "runner: _bookkeeping_sync"),
        (runner, "propose_draft_token_ids", "runner: propose_draft_token_ids"),
        (runner, "_async_next_tokens", "bole: _async_next_tokens"),
        (runner, "_update_states_after_model_execute", "runner: _update_states_after_model_execute"),
        (runner, "_determine_batch_execution_and_padding", "runner: _determine_batch_execution_and_padding"),
        (runner, "_get_slot_mappings", "runner: _get_slot_mappings"),
        (runner, "_calc_spec_decode_metadata", "runner: _calc_spec_decode_metadata"),
        (runner, "_get_valid_sampled_token_count", "runner: _get_valid_sampled_token_count"),
        (runner, "_prepare_input_ids", "runner: _prepare_input_ids"),
        (runner.model, "compute_logits", "runner: model.compute_logits"),
        (early_drafting, "launch", "bole: early_drafting.launch"),
        (early_drafting, "_draft_before_walk", "bole: _draft_before_walk"),
        (early_drafting, "compact_accepted_kv", "bole: compact_accepted_kv"),
        (early_drafting, "commit_step", "bole: commit_step"),
        (early_drafting, "greedy_walk", "bole: greedy_walk"),
        (early_drafting, "synthetic_targets", "bole: synthetic_targets"),
        (commit, "commit_step", "bole: commit_step (after the walk)"),
        (mtp_tree_drafter.MTPTreeDrafter, "first_pass_all_rows", "bole: first_pass_all_rows"),
        (mtp_tree_drafter.MTPTreeDrafter, "forward_device_rows", "bole: forward_device_rows"),
        (mtp_tree_drafter.MTPTreeDrafter, "propose_from_walk", "bole: propose_from_walk"),
        (device_beam.DeviceBeam, "grow_deferred", "bole: grow_deferred"),
        (device_beam.LevelPlan, "of", "bole: LevelPlan.of"),
        (device_beam, "quota_selection", "bole: quota_selection"),
        (beam_graphs.BeamGraphs, "start", "bole: BeamGraphs.start"),
        (beam_graphs.BeamGraphs, "run", "bole: BeamGraphs.run"),
        (verify_graphs.VerifyGraphs, "forward", "bole: VerifyGraphs.forward"),
        (verify_graphs.VerifyGraphs, "forest_tensors", "bole: VerifyGraphs.forest_tensors"),
        (gdn, "commit_step", "bole: gdn.commit_step"),
        (torch.cuda.CUDAGraph, "replay", "torch: CUDAGraph.replay"),
    ]:
        timer.wrap(obj, name, label)
    # Every metadata builder class the step uses (one label per class and method).
    builders = {type(b) for groups in runner.attn_groups for g in groups for b in g.metadata_builders}
    for cls in builders:
        for name in ("build", "update_block_table"):
            if name in cls.__dict__ or hasattr(cls, name):
                timer.wrap(cls, name, f"builder: {cls.__name__}.{name}")
