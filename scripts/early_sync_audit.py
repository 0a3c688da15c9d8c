"""Where Bole's drafting before the walk reads tensors on the host (each such read waits for the device on a GPU).

    .venv/bin/python scripts/early_sync_audit.py [synthetic]

Runs the bundled tiny Qwen3.5 on CPU with the drafting before the walk (``early_drafting``, the default): three
greedy requests and a seeded sampled one, then three more greedy ones whose prompts run in chunks beside the
others' trees (at most 4 requests and 32 tokens a step: mixed steps); ``synthetic``: synthetic acceptance. It
counts, per call site in ``vllm_bole``, the host reads of tensors (``tolist``, ``item``, ``numpy``,
``bool``/``int``/``float``, ``nonzero``, masked indexing, ...) made inside ``early_drafting.launch``, which the
runner calls right behind the target forward, and in a second table those inside the drafting after a step without
trees (the prompts' steps: ``Drafting.propose`` without a verified forest), which the runner queues behind that
forward too. On a GPU the drafting overlaps the forward only if none of them touches a device tensor. On CPU the
kernels' torch references run and read on the host by design (``kernels/*/reference.py``, ``kernels/forest.py``,
``attention/tree_rows.py``, the CPU branch of ``worker/kv_compaction.py``). Two more sites are known to read host
data only on a GPU: ``MTPTreeDrafter._metadata`` (its ``seq_lens_cpu`` is built on the host) and
``LevelPlan.host_seq_lens`` (the eager levels; on a GPU the levels replay their graphs and read it only while
capturing). Any other site listed needs a look.
"""

import collections
import os
import random
import sys
import traceback

os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")

import torch  # noqa: E402

HITS: collections.Counter = collections.Counter()
PREFILL_HITS: collections.Counter = collections.Counter()   # (the drafting after a step without trees)
AUDIT = [None]   # the counter of the audited call running now, if any


def _site() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "vllm_bole" in frame.filename:
            return f"{frame.filename.split('vllm_bole/')[-1]}:{frame.lineno} {frame.line}"
    return "?"


def _count(owner, name: str, when=None) -> None:
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        if AUDIT[0] is not None and (when is None or when(*args, **kwargs)):
            AUDIT[0][(name, _site())] += 1
        return original(*args, **kwargs)

    setattr(owner, name, counted)


def _masked(_tensor, index, *_rest) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def main() -> None:
    for name in ("tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu",
                 "unique"):
        _count(torch.Tensor, name)
    _count(torch.Tensor, "__getitem__", _masked)
    _count(torch.Tensor, "__setitem__", _masked)
    for name in ("nonzero", "masked_select", "unique"):
        _count(torch, name)

    from vllm import LLM, SamplingParams

    from vllm_bole._vllm_compat import model_runner_of
    from vllm_bole.testing.tiny_models import engine_kwargs, tiny_model_dir
    from vllm_bole.worker import early_drafting

    from vllm_bole.worker.drafting import Drafting

    def audited(call, hits, when=lambda *args: True):
        """``call`` counting its host reads into ``hits`` when ``when`` holds for its arguments."""
        def wrapper(*args, **kwargs):
            if not when(*args):
                return call(*args, **kwargs)
            AUDIT[0] = hits
            try:
                return call(*args, **kwargs)
            finally:
                AUDIT[0] = None

        return wrapper

    early_drafting.launch = audited(early_drafting.launch, HITS)
    Drafting.propose = audited(Drafting.propose, PREFILL_HITS, when=lambda self, *_: self.runner._bole_forest is None)
    spec = {"method": "bole", "num_speculative_tokens": 3, "topk": 4, "budget": "auto"}
    if sys.argv[1:] == ["synthetic"]:
        spec["synthetic_acceptance"] = True
    kwargs = engine_kwargs("qwen3_5") | {"max_num_seqs": 4, "max_num_batched_tokens": 32}
    llm = LLM(model=tiny_model_dir("qwen3_5"), **kwargs, speculative_config=spec)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 400) for _ in range(n)]} for n in (12, 12, 12, 12, 40, 70, 25)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    params = [greedy] * 3 + [SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)] + [greedy] * 3
    llm.generate(prompts, params, use_tqdm=False)
    runner = model_runner_of(llm)
    print(f"steps drafted before the walk: {runner.bole_early_draft_steps} "
          f"(beside prefill chunks: {runner.bole_early_mixed_steps})")
    for title, hits in (("drafting before the walk", HITS), ("drafting after a step without trees", PREFILL_HITS)):
        print(f"\n{title}\n\n| reads | call | site |\n|---|---|---|")
        for (name, where), n in sorted(hits.items(), key=lambda x: -x[1]):
            print(f"| {n} | {name} | `{where}` |")


if __name__ == "__main__":
    main()
