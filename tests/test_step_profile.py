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
