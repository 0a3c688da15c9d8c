"""Run multi-turn conversations through one vLLM engine and write each turn's outputs and prefix-cache counters.

    python -m vllm_bole.testing.multi_turn_run --spec SPEC.json --out OUT.json

SPEC: {"model": dir, "kind": "qwen3_5", "engine": {LLM kwargs}, "prompts": [[ids] per conversation],
"replies": [[[ids] per conversation] per later turn], "max_tokens": n, "logprobs": k, "cpu_async_scheduling":
bool (``engine_run.force_cpu_async_scheduling``), "states_out": path}. Turn 1 sends every
conversation's prompt at once (greedy, ``ignore_eos``); each later turn sends every conversation's history (its
prompts, outputs and replies so far) plus that turn's reply, again all at once, so conversations interleave in the
batch and each turn's prompt extends the previous turn's prompt and output. OUT: per turn, the outputs in the
``engine_run`` format (``tokens``, ``logprobs``, ``prompt_ids``, ``cached_tokens``) and the turn's increase of vLLM's
``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``; at the end, ``vllm:kv_cache_usage_perc``, Bole's step
counters (``engine_run.step_counts``) and its CUDA graphs' replays (``bole_graphs``, GPU). With ``states_out``, the
GDN states of every block in the prefix cache at the end go there (:func:`cached_gdn_states`, ``torch.save``).
"""

from vllm_bole.testing.engine_run import (force_cpu_async_scheduling, graph_summary, same_cpu_attention_as_bole,
                                          spec_cli, step_counts)


COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "kv_cache_usage_perc", "num_preemptions")


def counters(llm) -> dict:
    """vLLM's prefix-cache, KV-cache usage and preemption metrics (``vllm:`` left off their names); the engine
    needs ``disable_log_stats=False``."""
    return {name: m.value for m in llm.get_metrics() if (name := m.name.removeprefix("vllm:")) in COUNTERS}


def cached_gdn_states(llm) -> dict:
    """The conv and SSM states of every GDN state block in the prefix cache, ``{layer: {block hash (hex): [conv,
    ssm]}}``: the states vLLM hands a later request that hits the block. Hashes agree between engines started with
    the same ``PYTHONHASHSEED`` (vLLM's first block hash derives from it), whatever their KV-cache groups."""
    from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id
    from vllm.v1.kv_cache_interface import MambaSpec

    from vllm_bole._vllm_compat import engine_core_of, model_runner_of

    runner = model_runner_of(llm)
    groups = runner.kv_cache_config.kv_cache_groups
    layers = runner.compilation_config.static_forward_context
    states: dict = {}
    for block in engine_core_of(llm).scheduler.kv_cache_manager.block_pool.blocks:
        key = block.block_hash
        group = groups[get_group_id(key)] if key is not None else None
        if group is None or not isinstance(group.kv_cache_spec, MambaSpec):
            continue
        for name in group.layer_names:
            cache = layers[name].kv_cache
            states.setdefault(name, {})[get_block_hash(key).hex()] = [cache[0][block.block_id].clone(),
                                                                      cache[1][block.block_id].clone()]
    return states


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    from vllm_bole.testing.tiny_models import engine_kwargs

    if spec.get("cpu_async_scheduling"):
        force_cpu_async_scheduling()
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
                            "cached_tokens": o.num_cached_tokens,
                            "logprobs": [{int(t): lp.logprob for t, lp in step.items()} for step in c.logprobs or []]})
            h += list(c.token_ids)
        turns.append({"outputs": results,
                      **{k: after[k] - before.get(k, 0) for k in ("prefix_cache_queries", "prefix_cache_hits")}})
    if spec.get("states_out"):
        import torch

        torch.save(cached_gdn_states(llm), spec["states_out"])
    return {"turns": turns, "kv_cache_usage_end": counters(llm).get("kv_cache_usage_perc"),
            "block_size": llm.llm_engine.vllm_config.cache_config.block_size, "bole_graphs": graph_summary(llm),
            "async_scheduling": llm.llm_engine.vllm_config.scheduler_config.async_scheduling,
            **step_counts(llm)}


def main() -> None:
    spec_cli(run, __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
