"""The runner's step profiler (worker/step_profile.py): phase means over tree steps, whole-step wall time, and
steps without trees left out."""

import time

from vllm_bole.worker.step_profile import StepProfiler


def test_means_over_tree_steps_only():
    profiler = StepProfiler(every=1 << 30)
    profiler.end_step(tree_step=False)          # a prefill step: starts the wall clock, not counted
    for _ in range(3):
        with profiler.phase("draft"):
            time.sleep(0.002)
        profiler.end_step(tree_step=True)
    with profiler.phase("draft"):
        pass
    profiler.end_step(tree_step=False)
    means = profiler.means()
    assert profiler.steps == 3 and set(means) == {"draft", "step"}
    assert 2.0 <= means["draft"] <= means["step"]   # the step's wall time holds its phases
    assert StepProfiler(every=4).means() == {}


def test_logged_report_every_n_steps(monkeypatch):
    from vllm_bole.worker import step_profile

    lines = []
    monkeypatch.setattr(step_profile.logger, "info", lambda fmt, *args: lines.append(fmt % args))
    profiler = StepProfiler(every=2)
    for _ in range(2):
        with profiler.phase("walk"):
            pass
        profiler.end_step(tree_step=True)
    assert len(lines) == 1 and "walk" in lines[0] and "step" in lines[0] and profiler.means() == {}


class _FakeEngine:
    """Steps like vLLM's LLMEngine: each step gives every unfinished request one more token."""

    def __init__(self, steps_needed: int):
        self.requests, self.left = {}, steps_needed

    def add_request(self, request_id, prompt, params):
        self.requests[request_id] = 0

    def has_unfinished_requests(self):
        return self.left > 0

    def step(self):
        from types import SimpleNamespace

        self.left -= 1
        out = []
        for rid in self.requests:
            self.requests[rid] += 1
            out.append(SimpleNamespace(request_id=rid, outputs=[SimpleNamespace(token_ids=[0] * self.requests[rid])]))
        return out


def test_stepped_generate_calls_back_before_every_step():
    """benchmarks/step_profile.py drives the engine itself when a callback is given (the profiler then starts
    after the prefill steps); the token count is each request's last output."""
    from types import SimpleNamespace

    from e2e_support import load_benchmark

    script = load_benchmark("step_profile")
    llm, seen = SimpleNamespace(llm_engine=_FakeEngine(steps_needed=5)), []
    tokens, seconds = script._generate(llm, batch=3, prompt_len=4, new_tokens=5, seed=0, on_step=seen.append)
    assert seen == [0, 1, 2, 3, 4] and tokens == 15 and seconds >= 0


def test_slow_steps_logged_with_both_steps_facts(monkeypatch):
    """VLLM_BOLE_SLOW_STEP_MS: an interval past the threshold names the step before it and the step after it;
    shorter intervals, the first step and an interval without a request in both steps (idle) log nothing."""
    from vllm_bole.worker import step_profile
    from vllm_bole.worker.step_profile import SlowSteps

    lines, clock = [], iter([0.0, 0.010, 0.300, 0.305, 0.900])
    monkeypatch.setattr(step_profile.logger, "warning", lambda fmt, *args: lines.append(fmt % args))
    monkeypatch.setattr(step_profile.time, "perf_counter", lambda: next(clock))
    steps = SlowSteps(threshold_ms=100)
    for reqs, facts in ((["a"], "first"), (["a"], "decode"), (["a", "b"], "mixed"), (["a", "b"], "decode again"),
                        (["c"], "after idle")):
        steps.begin(reqs, facts)
    assert len(lines) == 1 and "290 ms" in lines[0] and "previous: decode;" in lines[0] and "this: mixed" in lines[0]
    monkeypatch.setenv("VLLM_BOLE_SLOW_STEP_MS", "0")
    assert SlowSteps.from_env() is None
    monkeypatch.setenv("VLLM_BOLE_SLOW_STEP_MS", "250")
    assert SlowSteps.from_env().threshold_ms == 250


def test_step_facts_count_prefill_chunks():
    """A request with more tokens than its drafts and root is a prefill chunk; one with drafts is not."""
    from types import SimpleNamespace

    from vllm_bole.worker.model_runner import BoleModelRunnerMixin

    runner = SimpleNamespace(bole_early_draft_steps=7, bole_graph_counts=lambda: (3, 5))
    out = SimpleNamespace(num_scheduled_tokens={"a": 5, "b": 1, "c": 512}, total_num_scheduled_tokens=518,
                          scheduled_spec_decode_tokens={"a": [1, 2, 3, 4]})
    facts = BoleModelRunnerMixin._bole_step_facts(runner, out)
    assert facts == "3 requests, 518 tokens, 1 prefilling; so far 7 early-drafted steps, graphs 3 verify / 5 drafter"
