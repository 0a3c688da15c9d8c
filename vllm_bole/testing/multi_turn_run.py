"""Run multi-turn conversations through one vLLM engine and write each turn's outputs and prefix-cache counters.

    python -m vllm_bole.testing.multi_turn_run --spec SPEC.json --out OUT.json

SPEC: {"model": dir, "kind": "qwen3_5", "engine": {LLM kwargs}, "prompts": [[ids] per conversation],
"replies": [[[ids] per conversation] per later turn], "max_tokens": n, "logprobs": k}. Turn 1 sends every
conversation's prompt at once (greedy, ``ignore_eos``); each later turn sends every conversation's history (its
prompts, outputs and replies so far) plus that turn's reply, again all at once, so conversations interleave in the
batch and each turn's prompt extends the previous turn's prompt and output. OUT: per turn, the outputs in the
``engine_run`` format (``tokens``, ``logprobs``, ``prompt_ids``) and the turn's increase of vLLM's
``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``; at the end, ``vllm:kv_cache_usage_perc``, Bole's step
counters (``engine_run.step_counts``) and its CUDA graphs' replays (``bole_graphs``, GPU).
"""

from vllm_bole.testing.engine_run import graph_summary, same_cpu_attention_as_bole, spec_cli, step_counts


COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "kv_cache_usage_perc", "num_preemptions")


def counters(llm) -> dict:
    """vLLM's prefix-cache, KV-cache usage and preemption metrics (``vllm:`` left off their names); the engine
    needs ``disable_log_stats=False``."""
    return {name: m.value for m in llm.get_metrics() if (name := m.name.removeprefix("vllm:")) in COUNTERS}


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    from vllm_bole.testing.tiny_models import engine_kwargs

    same_cpu_attention_as_bole()
    llm = LLM(model=spec["model"], disable_log_stats=False,
              **(engine_kwargs(spec.get("kind", "qwen3_5")) | spec.get("engine", {})))
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True,
                            logprobs=spec.get("logprobs"))
    history = [list(p) for p in spec["prompts"]]
    turns = []
    for turn in range(1 + len(spec["replies"])):
        if turn:
            history = [h + list(reply) for h, reply in zip(history, spec["replies"][turn - 1])]
        before = counters(llm)
        outs = llm.generate([{"prompt_token_ids": h} for h in history], params, use_tqdm=False)
        after = counters(llm)
        results = []
        for h, o in zip(history, outs):
            c = o.outputs[0]
            results.append({"tokens": list(c.token_ids), "prompt_ids": list(o.prompt_token_ids),
                            "logprobs": [{int(t): lp.logprob for t, lp in step.items()} for step in c.logprobs or []]})
            h += list(c.token_ids)
        turns.append({"outputs": results,
                      **{k: after[k] - before.get(k, 0) for k in ("prefix_cache_queries", "prefix_cache_hits")}})
    return {"turns": turns, "kv_cache_usage_end": counters(llm).get("kv_cache_usage_perc"),
            "block_size": llm.llm_engine.vllm_config.cache_config.block_size, "bole_graphs": graph_summary(llm),
            **step_counts(llm)}


def main() -> None:
    spec_cli(run, __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
