"""Bole's start-up warm-up (worker/warmup.py): what it runs, when it runs, and that nothing of it stays behind.

An engine that warmed up must serve exactly as one that did not: the same greedy outputs, the same spec-decode
counters and prefix-cache hits (vLLM's metrics never see the warm-up's requests), the same draft vocabulary and step
counters (the runner forgets the warm-up's random traffic)."""

from types import SimpleNamespace

import pytest
import torch

from e2e_support import bole_engine, random_requests, run_engine, vocab_size
from vllm_bole.config import parse_bole_config
from vllm_bole.worker import warmup
from vllm_bole.worker.warmup import batch_sizes, prompt_lengths


def test_batch_sizes_are_the_request_buckets():
    assert batch_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert batch_sizes(1) == [1]


def test_prompt_lengths_cover_both_attention_routes_where_they_fit():
    assert prompt_lengths(4096) == [warmup.SHORT_PROMPT, warmup.LONG_PROMPT]
    assert warmup.LONG_PROMPT > 512   # past the tree-attention route's threshold (attention/tree_attn_gpu.py)
    assert prompt_lengths(256) == [warmup.SHORT_PROMPT]
    assert prompt_lengths(40) == [8]


def _vllm_config(warmup_setting, enforce_eager=False):
    cfg, _ = parse_bole_config({"method": "bole", "warmup": warmup_setting})
    return SimpleNamespace(additional_config={"bole": cfg.to_dict()},
                           model_config=SimpleNamespace(enforce_eager=enforce_eager))


@pytest.mark.parametrize("cuda", [True, False])
def test_auto_warms_up_where_cuda_graphs_run(monkeypatch, cuda):
    monkeypatch.setattr(warmup.current_platform, "is_cuda", lambda: cuda)
    assert warmup.wanted(_vllm_config("auto")) is cuda
    assert warmup.wanted(_vllm_config("auto", enforce_eager=True)) is False
    assert warmup.wanted(_vllm_config(True, enforce_eager=True)) is True
    assert warmup.wanted(_vllm_config(False)) is False
    assert warmup.wanted(SimpleNamespace(additional_config={})) is False   # not a Bole engine


@pytest.mark.vllm
def test_warmed_up_engine_serves_as_a_cold_one(tmp_path):
    """Same outputs, counters, prefix-cache hits, draft vocabulary and step counts with and without the warm-up,
    which the log reports (batch sizes 1, 2, 4 and 8: 15 requests of the short prompt)."""
    from vllm_bole.testing.tiny_models import tiny_model_dir

    model = tiny_model_dir()
    vocab = vocab_size(model)
    shared = random_requests(vocab, [40], 1)[0]["prompt"]
    requests = [{"prompt": shared + r["prompt"], "max_tokens": 48}
                for r in random_requests(vocab, [12, 30, 7, 21, 16, 9], 48, seed=5)]
    runs = {}
    for name, setting in (("cold", False), ("warm", True)):
        engine = bole_engine(tmp_path, name, depth=4, topk=2, budget=24, drafter="mtp", max_num_seqs=8,
                             enable_prefix_caching=True, async_scheduling=False)
        engine["speculative_config"]["warmup"] = setting
        runs[name] = run_engine(tmp_path, name, {"model": model, "requests": requests, "engine": engine})
    cold, warm = runs["cold"], runs["warm"]
    log = (tmp_path / "warm.log").read_text()
    assert "Bole warm-up: 15 requests (batch sizes 1,2,4,8, prompts of 32 tokens)" in log, log[-3000:]
    assert "Bole warm-up" not in (tmp_path / "cold.log").read_text()
    assert [o["tokens"] for o in warm["outputs"]] == [o["tokens"] for o in cold["outputs"]]
    assert [o["cached_tokens"] for o in warm["outputs"]] == [o["cached_tokens"] for o in cold["outputs"]]
    assert warm["counters"] == cold["counters"] and cold["counters"]["num_drafts"] > 0
    assert warm["draft_vocab"] == cold["draft_vocab"]
    assert warm["draft_vocab_refreshes"] == cold["draft_vocab_refreshes"]
    for key in ("first_pass_steps", "early_draft_steps", "queued_trees", "chain_steps", "budgets"):
        assert warm[key] == cold[key], key


@pytest.mark.vllm
@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton kernels compile on GPUs only")
def test_no_kernel_compiles_after_the_warm_up(tmp_path):
    """vLLM's JIT monitor in "error" mode fails the step that compiles a kernel after the start. Long prompts are
    prefilled in small chunks beside the trees of requests already decoding (such steps run eagerly, with launch
    parameters from their trees), greedy and sampled: every request completes."""
    from vllm_bole.testing.tiny_models import tiny_model_dir

    model = tiny_model_dir()
    requests = random_requests(vocab_size(model), [12, 300, 40, 520, 90, 700, 25, 260], 40, seed=9)
    for r in requests[1::2]:
        r["temperature"] = 1.0
    engine = bole_engine(tmp_path, "strict", depth=4, topk=2, budget="auto", drafter="mtp", max_num_seqs=8,
                         max_num_batched_tokens=128, max_model_len=1024, jit_monitor_mode="error")
    engine["speculative_config"]["warmup"] = True
    out = run_engine(tmp_path, "strict", {"model": model, "requests": requests, "engine": engine})
    log = (tmp_path / "strict.log").read_text()
    assert "Bole warm-up: tree kernels launched in every variant of eager steps" in log, log[-3000:]
    assert [len(o["tokens"]) for o in out["outputs"]] == [40] * len(requests)
    assert out["counters"]["num_drafts"] > 0


def test_jit_monitor_paused_and_resumed(monkeypatch):
    """The warm-up's compilations are not reported by vLLM's JIT monitor; afterwards its hook is back."""
    knobs = pytest.importorskip("triton").knobs
    from vllm.utils import jit_monitor

    from vllm_bole._vllm_compat import pause_jit_monitor, resume_jit_monitor

    def hook(**kwargs):
        return None

    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", hook)
    monkeypatch.setattr(knobs.autotuning, "print", True)
    monkeypatch.setattr(jit_monitor, "HAS_TRITON", True)
    monkeypatch.setattr(jit_monitor, "_active", False)
    assert pause_jit_monitor() is None and knobs.runtime.jit_post_compile_hook is hook   # not active: untouched
    monkeypatch.setattr(jit_monitor, "_active", True)
    saved = pause_jit_monitor()
    assert knobs.runtime.jit_post_compile_hook is None and knobs.autotuning.print is False
    resume_jit_monitor(saved)
    assert knobs.runtime.jit_post_compile_hook is hook and knobs.autotuning.print is True


def test_random_prompts_hold_no_special_token():
    import numpy as np

    config = SimpleNamespace(image_token_id=5, vision_start_token_id=6, eos_token_id=7, hidden_size=9)
    model_config = SimpleNamespace(hf_config=config, hf_text_config=SimpleNamespace(pad_token_id=3))
    avoid = warmup.special_token_ids(model_config)
    assert avoid == {3, 5, 6, 7}
    prompts = warmup.random_prompts(np.random.default_rng(0), 4, 50, 10, avoid)
    assert len(prompts) == 4 and all(len(p) == 50 for p in prompts)
    assert {t for p in prompts for t in p} == {0, 1, 2, 4, 8, 9}


class _FakeEngineCore:
    """The engine core's face the warm-up uses: each step finishes every request that has run ``steps_each`` steps
    (``stuck``: schedules nothing, ever)."""

    def __init__(self, max_num_seqs=4, stuck=False, steps_each=3):
        self.vllm_config = SimpleNamespace(
            scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs, enable_chunked_prefill=True,
                                             max_num_batched_tokens=8192),
            model_config=SimpleNamespace(max_model_len=4096, get_vocab_size=lambda: 100,
                                         hf_config=SimpleNamespace(), hf_text_config=SimpleNamespace()))
        self.running, self.batch_queue, self.stuck, self.steps_each = {}, None, stuck, steps_each
        self.events, self.batches = [], []
        self.scheduler = SimpleNamespace(has_requests=lambda: bool(self.running))
        self.model_executor = SimpleNamespace(collective_rpc=self._rpc)

    def _rpc(self, method):
        self.events.append(method)
        return [(0, 0)] if method == "bole_graph_counts" else [None]

    def preprocess_add_request(self, request):
        return request, 0

    def add_request(self, request, wave=0):
        assert request.sampling_params.ignore_eos and request.request_id.startswith("bole-warmup-")
        self.running[request.request_id] = 0

    def step_fn(self):
        if self.stuck:
            return {}, False
        self.batches.append(len(self.running))
        for rid in list(self.running):
            self.running[rid] += 1
            if self.running[rid] >= self.steps_each:
                del self.running[rid]
        return {}, True

    def post_step(self, executed):
        pass

    def abort_requests(self, ids):
        self.events.append(("abort", len(ids)))
        for rid in ids:
            self.running.pop(rid, None)

    def reset_prefix_cache(self):
        self.events.append("reset_prefix_cache")


def test_warm_up_runs_every_bucket_staggered_then_resets(monkeypatch):
    monkeypatch.setattr(warmup, "wanted", lambda config: True)
    core = _FakeEngineCore(max_num_seqs=4)
    warmup.warm_up(core)
    # per prompt length (32, 640) and batch size (1, 2, 4): half, then the rest joins after STAGGER_STEPS steps
    assert core.batches == [1, 1, 1, 1, 1, 2, 1, 1, 2, 2, 4, 2, 2] * 2
    assert core.events == ["bole_graph_counts", "bole_before_warmup", "bole_warm_up_kernels", "reset_prefix_cache",
                           "bole_after_warmup", "bole_graph_counts"]


def test_warm_up_gives_up_on_requests_never_scheduled(monkeypatch):
    monkeypatch.setattr(warmup, "wanted", lambda config: True)
    core = _FakeEngineCore(stuck=True)
    warmup.warm_up(core)
    assert ("abort", 1) in core.events and not core.running
    assert core.events[-2:] == ["bole_after_warmup", "bole_graph_counts"]
