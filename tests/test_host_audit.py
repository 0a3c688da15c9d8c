"""The host audit of benchmarks/step_profile.py --host-audit (benchmarks/host_audit.py): inclusive and self times
of nested timed functions per step, nothing timed while off, and the wait report by call site."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import host_audit  # noqa: E402


class _Engine:
    def step(self):
        time.sleep(0.004)
        self.prepare()
        self.prepare()

    def prepare(self):
        time.sleep(0.003)


def test_inclusive_and_self_time_per_step():
    engine, timer = _Engine(), host_audit.HostTimer()
    timer.wrap(engine, "step", "engine: step")
    timer.wrap(engine, "prepare", "runner: prepare")
    timer.wrap(engine, "missing", "never")          # absent functions are skipped
    engine.step()                                    # off: not counted
    timer.on = True
    for _ in range(3):
        engine.step()
    timer.on = False
    engine.step()
    assert timer.calls == {"engine: step": 3, "runner: prepare": 6}
    step, prep = timer.total["engine: step"] / 3, timer.total["runner: prepare"] / 3
    assert prep >= 0.006 and step >= prep + 0.004
    # self: the step's own sleep only, not its two prepares
    assert 0.004 <= timer.self_time["engine: step"] / 3 < step - prep + 1e-3
    report = timer.report("B=1", "engine: step")
    lines = report.splitlines()
    assert lines[0].startswith("B=1: 3 steps") and "| runner: prepare |" in report
    row = next(x for x in lines if x.startswith("| runner: prepare |")).split("|")
    assert float(row[4]) == 2.0                      # calls per step
    assert lines.index(next(x for x in lines if x.startswith("| engine: step |"))) < lines.index(
        next(x for x in lines if x.startswith("| runner: prepare |")))   # sorted by inclusive time
    timer.reset()
    assert not timer.total and not timer.calls


def test_wait_report_lists_sites_by_time():
    audit = host_audit.SyncAudit.__new__(host_audit.SyncAudit)   # no patching: the report only
    import collections

    audit.waits = collections.defaultdict(lambda: [0, 0.0])
    audit.implicit = collections.Counter()
    audit.waits["event.synchronize @ a.py:1(f)"] = [4, 0.008]
    audit.waits["cuda.synchronize @ b.py:2(g)"] = [2, 0.020]
    audit.implicit["c.py:3(h)"] = 6
    text = audit.report("B=16", steps=2)
    lines = text.splitlines()
    first = next(i for i, x in enumerate(lines) if x.startswith("| cuda.synchronize"))
    second = next(i for i, x in enumerate(lines) if x.startswith("| event.synchronize"))
    assert first < second                            # the longer total wait first
    assert "| 1.00 | 10.000 |" in lines[first] and "| 2.00 | 4.000 |" in lines[second]
    assert "| c.py:3(h) | 3.00 |" in text


def test_call_sites_name_project_frames_innermost_first():
    from traceback import FrameSummary

    stack = [FrameSummary("/usr/lib/python3/threading.py", 1, "run"),
             FrameSummary("/x/site-packages/vllm/v1/engine/core.py", 10, "step"),
             FrameSummary("/work/main/vllm_bole/worker/model_runner.py", 20, "execute_model"),
             FrameSummary("/x/site-packages/torch/cuda/streams.py", 30, "synchronize")]
    assert host_audit._site(stack) == ("vllm_bole/worker/model_runner.py:20(execute_model) <- "
                                       "vllm/v1/engine/core.py:10(step)")
    assert host_audit._site(stack, depth=1) == "vllm_bole/worker/model_runner.py:20(execute_model)"
