"""Bole through vLLM's offline API: greedy generation with tree speculation, then acceptance statistics.

    python examples/offline.py                      # CPU: builds the bundled tiny Qwen3.5 and runs it
    python examples/offline.py --trained            # CPU: a small Qwen3.5 trained on Python sources, code prompts
    python examples/offline.py --model DIR --gpu    # any Qwen3.5 / Qwen3-Next checkpoint on a GPU

The tiny model has random weights: its text is noise and its acceptance says nothing about the method. The trained
stand-in (``vllm_bole/testing/train_small.py``, size ``small``) writes Python and its MTP head drafts it; it is
trained once on this machine's CPUs (25-35 minutes on 2 cores) and cached.
"""

import argparse
import os

PROMPTS = [
    "The river starts high in the hills",
    "A language model reads a piece of text and",
    "Hello there, my name is",
    "In the evening the wind comes down from the hills, and",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint directory (default: the bundled tiny Qwen3.5)")
    parser.add_argument("--trained", action="store_true",
                        help="the trained stand-in on held-out code prompts (with --model: DIR is such a stand-in)")
    parser.add_argument("--gpu", action="store_true", help="leave vLLM's GPU defaults alone")
    parser.add_argument("--depth", type=int, default=4, help="speculative_config.num_speculative_tokens")
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--budget", default="auto")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from vllm import LLM, SamplingParams

    from vllm_bole.testing.greedy_check import spec_decode_counters
    from vllm_bole.testing.tiny_models import engine_kwargs, tiny_model_dir

    if args.trained:
        from vllm_bole.testing.train_small import code_prompts, trained_model_dir

        model = args.model or trained_model_dir("small")
        prompts = [{"prompt_token_ids": ids} for ids in code_prompts(model, count=4)]
    else:
        model, prompts = args.model or tiny_model_dir("qwen3_5"), PROMPTS
    kwargs = {} if args.gpu else engine_kwargs("qwen3_5")
    budget = args.budget if args.budget == "auto" else int(args.budget)
    llm = LLM(model=model, disable_log_stats=False, **kwargs, speculative_config={
        "method": "bole", "num_speculative_tokens": args.depth, "topk": args.topk, "budget": budget})
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    tokenizer = llm.get_tokenizer()
    for out in outputs:
        prompt = out.prompt if out.prompt is not None else tokenizer.decode(out.prompt_token_ids)
        if args.trained:   # code reads better as code than as a repr
            print(f"--- prompt:\n{prompt}\n--- continuation:\n{out.outputs[0].text}\n")
        else:
            print(f"--- {prompt!r}\n{out.outputs[0].text!r}")
    c = spec_decode_counters(llm.get_metrics())
    print(f"\nBole tree speculation: {c['num_drafts']} verification steps, {c['num_draft_tokens']} tree nodes, "
          f"{c['num_accepted_tokens']} accepted")
    print(f"mean acceptance length (tokens per step): {c['mean_acceptance_length']:.2f}")
    print("accepted per depth:", c["accepted_per_pos"][: args.depth])


if __name__ == "__main__":
    main()
