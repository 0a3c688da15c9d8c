"""Abort requests between engine steps and report what every other request emitted and what the engine still holds.

    python -m vllm_bole.testing.abort_run --spec SPEC.json --out OUT.json

SPEC: {"model": dir, "kind": "qwen3_5", "engine": {LLM kwargs}, "cpu_async_scheduling": bool,
"requests": [engine_run request dicts], "abort": [indices into requests], "after_steps": [k, ...],
"after": [engine_run request dicts], "logprobs": n}. For each k of ``after_steps`` one round adds every request,
runs k engine steps, aborts the requests of ``abort`` and runs the rest to completion; then the ``after`` requests
run alone, in the slots the aborted ones left. Under async scheduling an engine step returns while the next one is
queued, so an abort lands while the aborted request's next tree is drafted or queued. OUT: per round the outputs of
the requests not aborted (in request order) and how many tokens the aborted ones had emitted (``aborted_outputs``);
the ``after`` outputs; the request ids that the scheduler, the model runner and Bole's per-request state still hold
at the end (``held``); vLLM's prefix-cache, KV-usage and preemption metrics at the end (``counters``,
:func:`multi_turn_run.counters`).
"""

from .._vllm_compat import engine_core_of
from .engine_run import (_prompt, _runner, _sampling_params, force_cpu_async_scheduling, same_cpu_attention_as_bole,
                         spec_cli)
from .multi_turn_run import counters


def _drain(engine, wanted: set[str], outputs: dict, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return
        for out in engine.step():
            if out.finished and out.request_id in wanted:
                outputs[out.request_id] = _output(out)
    raise RuntimeError(f"requests still unfinished after {max_steps} steps")


def _output(out) -> dict:
    c = out.outputs[0]
    top = [{int(t): lp.logprob for t, lp in step.items()} for step in (c.logprobs or [])]
    return {"tokens": list(c.token_ids), "finish_reason": c.finish_reason, "logprobs": top}


def output_counts(llm, ids) -> list[int | None]:
    """Output tokens the scheduler holds of each request of ``ids`` (None: not there), e.g. just before an abort."""
    requests = engine_core_of(llm).scheduler.requests   # (vLLM adds a suffix to each request id)
    return [next((r.num_output_tokens for key, r in requests.items() if key.startswith(f"{rid}-")), None)
            for rid in ids]


def held_state(llm) -> dict:
    """What the engine holds once every request is done: the scheduler's requests and KV cache usage, the model
    runner's requests and batch, and Bole's per-request state (draft trees, queued and pending drafts)."""
    core = engine_core_of(llm)
    runner = _runner(llm)
    drafts = runner.bole_forest_builder   # the drafts awaiting verification
    queued = drafts.queued
    return {"scheduler_requests": sorted(core.scheduler.requests),
            "kv_cache_usage": core.scheduler.kv_cache_manager.usage,
            "runner_requests": sorted(runner.requests),
            "batch_requests": [r for r in runner.input_batch.req_ids if r is not None],
            "draft_trees": sorted(drafts.trees),
            "host_emitted": sorted(runner.bole_drafting.host_emitted),
            "queued_drafts": None if queued is None else sorted(queued[2]),
            "pending_drafts": runner.bole_drafting.pending is not None}


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    from vllm_bole.testing.tiny_models import engine_kwargs

    if spec.get("cpu_async_scheduling"):
        force_cpu_async_scheduling()
    same_cpu_attention_as_bole()
    llm = LLM(model=spec["model"], disable_log_stats=False,
              **(engine_kwargs(spec.get("kind", "qwen3_5")) | spec.get("engine", {})))
    engine = llm.llm_engine
    rounds = []
    for k in spec["after_steps"]:
        ids = [f"round{k}-{i}" for i in range(len(spec["requests"]))]
        for rid, r in zip(ids, spec["requests"]):
            engine.add_request(rid, _prompt(r), _sampling_params(SamplingParams, r, spec.get("logprobs")))
        outputs = {}
        for _ in range(k):
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = _output(out)
        aborted = [ids[i] for i in spec["abort"]]
        aborted_outputs = output_counts(llm, aborted)
        engine.abort_request(aborted)
        kept = [rid for rid in ids if rid not in aborted]
        _drain(engine, set(kept), outputs)
        rounds.append({"after_steps": k, "aborted": aborted, "aborted_outputs": aborted_outputs,
                       "outputs": [outputs.get(rid) for rid in kept]})
    after_ids = [f"after-{i}" for i in range(len(spec.get("after", [])))]
    for rid, r in zip(after_ids, spec.get("after", [])):
        engine.add_request(rid, _prompt(r), _sampling_params(SamplingParams, r, spec.get("logprobs")))
    after = {}
    _drain(engine, set(after_ids), after)
    _drain(engine, set(), {})
    return {"rounds": rounds, "after": [after.get(rid) for rid in after_ids], "held": held_state(llm),
            "scheduling": {"async_scheduling": bool(engine.vllm_config.scheduler_config.async_scheduling)},
            "queued_trees": _runner(llm).step_counts()["queued_trees"], "counters": counters(llm)}


def main() -> None:
    spec_cli(run, __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
