"""The runner's step profiler (worker/step_profile.py): phase means over tree steps, whole-step wall time, and
steps without trees left out."""

import time

from vllm_bole.worker.step_profile import StepProfiler


def test_means_by_kind_over_tree_steps_only():
    profiler = StepProfiler(every=1 << 30)
    profiler.end_step(None)          # a prefill step: starts the wall clock, not counted
    for _ in range(3):
        with profiler.phase("draft"):
            time.sleep(0.002)
        profiler.end_step("trees")
    with profiler.phase("draft"):
        time.sleep(0.02)
    profiler.end_step("mixed")
    with profiler.phase("draft"):
        pass
    profiler.end_step(None)
    trees, mixed = profiler.means(), profiler.means("mixed")
    assert profiler.steps == {"trees": 3, "mixed": 1} and set(trees) == set(mixed) == {"draft", "step"}
    assert 2.0 <= trees["draft"] <= trees["step"] < 20.0 <= mixed["draft"] <= mixed["step"]
    assert StepProfiler(every=4).means() == {}


def test_logged_report_every_n_steps_of_a_kind(monkeypatch):
    from vllm_bole.worker import step_profile

    lines = []
    monkeypatch.setattr(step_profile.logger, "info", lambda fmt, *args: lines.append(fmt % args))
    profiler = StepProfiler(every=2)
    for kind in ("trees", "mixed", "trees"):
        with profiler.phase("walk"):
            pass
        profiler.end_step(kind)
    assert len(lines) == 1 and "2 tree-only steps" in lines[0] and "walk" in lines[0] and "step" in lines[0]
    assert profiler.means() == {} and set(profiler.means("mixed")) == {"walk", "step"}
    with profiler.phase("walk"):
        pass
    profiler.end_step("mixed")
    assert len(lines) == 2 and "2 mixed (trees beside prefill chunks) steps" in lines[1]


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


def test_arrivals_join_the_decoding_batch():
    """--arrivals: a request before every ``every``-th step from step ``every`` on, its tokens counted too."""
    from types import SimpleNamespace

    from e2e_support import load_benchmark

    script = load_benchmark("step_profile")
    arrivals = script.Arrivals(count=2, prompt_len=7, every=2)
    assert [arrivals.at(step) for step in range(7)] == [None, None, 0, None, 1, None, None]
    engine = _FakeEngine(steps_needed=6)
    tokens, _ = script._generate(SimpleNamespace(llm_engine=engine), batch=2, prompt_len=4, new_tokens=6, seed=0,
                                 arrivals=arrivals)
    assert engine.requests == {"profiled-0-0": 6, "profiled-0-1": 6, "arrival-0-0": 4, "arrival-0-1": 2}
    assert tokens == 18


def _facts(requests=1, prefilling=0, trees=1, early=0, verify=0, drafter=0):
    from vllm_bole.worker.step_profile import StepFacts

    return StepFacts(requests=requests, tokens=8 * requests, prefilling=prefilling, trees=trees, early_drafted=early,
                     verify_graphs=verify, drafter_graphs=drafter)


def test_slow_steps_logged_with_both_steps_facts(monkeypatch):
    """VLLM_BOLE_SLOW_STEP_MS: an interval past the threshold names the step before it and the step after it;
    shorter intervals, the first step and an interval without a request in both steps (idle) log nothing."""
    from vllm_bole.worker import step_profile
    from vllm_bole.worker.step_profile import StepTimes

    lines, clock = [], iter([0.0, 0.010, 0.300, 0.305, 0.900])
    monkeypatch.setattr(step_profile.logger, "warning", lambda fmt, *args: lines.append(fmt % args))
    monkeypatch.setattr(step_profile.logger, "info", lambda fmt, *args: None)
    monkeypatch.setattr(step_profile.time, "perf_counter", lambda: next(clock))
    steps = StepTimes(threshold_ms=100)
    for reqs, facts in ((["a"], _facts()), (["a"], _facts(early=1)), (["a", "b"], _facts(2, prefilling=1)),
                        (["a", "b"], _facts(2, early=1)), (["c"], _facts(early=2))):
        steps.begin(reqs, facts)
    assert len(lines) == 1 and "290 ms" in lines[0]
    assert "(previous: 1 requests, 8 tokens, 0 prefilling; so far 1 early-drafted steps" in lines[0]
    assert "this: 2 requests, 16 tokens, 1 prefilling;" in lines[0]
    monkeypatch.setenv("VLLM_BOLE_SLOW_STEP_MS", "0")
    assert StepTimes.from_env() is None
    monkeypatch.setenv("VLLM_BOLE_SLOW_STEP_MS", "250")
    assert StepTimes.from_env().threshold_ms == 250


def test_step_kinds():
    """A step's kind from its facts and the next step's: a graph count that moved is a capture; trees beside
    prefill chunks are mixed; tree-only steps are early-drafted when the counter moved."""
    assert _facts(verify=1).kind(_facts(verify=2)) == "capturing"
    assert _facts(drafter=3, early=1).kind(_facts(drafter=4, early=2)) == "capturing"
    assert _facts(prefilling=1).kind(_facts(early=1)) == "mixed_early"
    assert _facts(prefilling=1, early=1).kind(_facts(early=1)) == "mixed_late"
    assert _facts().kind(_facts(early=1)) == "trees_early"
    assert _facts(early=1).kind(_facts(early=1)) == "trees_late"
    assert _facts(trees=0, prefilling=1).kind(_facts()) == "prefill"
    assert _facts(trees=0).kind(_facts()) == "decode"


def test_step_times_summarised_by_kind(monkeypatch):
    """The summary line: steps, mean and longest ms and mean scheduled tokens per kind, logged once ``SUMMARY_EVERY_S`` passed and when the
    engine turns idle (at the first step after the gap), each step counted once; the idle gap itself is not a
    step, and a reset (after the warm-up) forgets what was not logged."""
    from vllm_bole.worker import step_profile
    from vllm_bole.worker.step_profile import StepTimes

    lines, now = [], [0.0]
    monkeypatch.setattr(step_profile.logger, "info", lambda fmt, *args: lines.append(fmt % args))
    monkeypatch.setattr(step_profile.logger, "warning", lambda fmt, *args: None)
    monkeypatch.setattr(step_profile.time, "perf_counter", lambda: now[0])
    steps = StepTimes(threshold_ms=1000)
    steps.SUMMARY_EVERY_S = 1.0

    def run(reqs, facts, ms):
        steps.begin(reqs, facts)
        now[0] += ms / 1e3

    run(["a"], _facts(), 10)                      # trees, early drafted (the next step's counter moved)
    run(["a"], _facts(early=1), 30)               # trees, drafted late (the counter stays)
    run(["a", "b"], _facts(2, prefilling=1, early=1), 20)   # mixed, early drafted
    run(["a", "b"], _facts(2, early=2), 40)       # a capture (the next step holds one graph more)
    run(["a", "b"], _facts(2, early=2, verify=1), 500)      # idle gap: request "c" alone follows
    assert lines == []
    run(["c"], _facts(early=2, verify=1), 10)
    assert lines == ["Bole step times: trees_early 1 steps, mean 10.0 ms, max 10 ms, 8 tokens; trees_late 1 steps, "
                     "mean 30.0 ms, max 30 ms, 8 tokens; mixed_early 1 steps, mean 20.0 ms, max 20 ms, 16 tokens; capturing "
                     "1 steps, mean 40.0 ms, max 40 ms, 16 tokens"]
    for ms in (600, 600):
        run(["c"], _facts(early=2, verify=1), ms)
    assert len(lines) == 1   # 1.21 s of steps, the last one not yet timed
    run(["c"], _facts(early=2, verify=1), 10)
    assert lines[1:] == ["Bole step times: trees_late 3 steps, mean 403.3 ms, max 600 ms, 8 tokens"]
    run(["c"], _facts(early=2, verify=1), 10)
    steps.reset()
    run(["c"], _facts(early=2, verify=1), 10)
    run(["d"], _facts(early=2, verify=1), 10)   # an idle gap after a reset: nothing left to log
    assert len(lines) == 2


def test_step_facts_count_prefill_chunks():
    """A request with more tokens than its drafts and root is a prefill chunk; one with drafts is not."""
    from types import SimpleNamespace

    from vllm_bole.worker.model_runner import BoleModelRunnerMixin

    runner = SimpleNamespace(bole_early_draft_steps=7, bole_graph_counts=lambda: (3, 5))
    out = SimpleNamespace(num_scheduled_tokens={"a": 5, "b": 1, "c": 512}, total_num_scheduled_tokens=518,
                          scheduled_spec_decode_tokens={"a": [1, 2, 3, 4]})
    facts = BoleModelRunnerMixin._bole_step_facts(runner, out)
    assert (facts.prefilling, facts.trees) == (1, 1)
    assert str(facts) == ("3 requests, 518 tokens, 1 prefilling; so far 7 early-drafted steps, "
                          "graphs 3 verify / 5 drafter")
