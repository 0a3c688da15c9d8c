"""benchmarks/trace_gaps.py: the GPU's idle time is charged to the innermost host scope running meanwhile, and
GPU time to the scope that launched it (through the trace's launch-to-kernel flows)."""

import gzip
import json

import pytest

from e2e_support import load_benchmark


def _module():
    return load_benchmark("trace_gaps")


def _scope(name, ts, dur, tid=1):
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def _kernel(ts, dur, corr):
    return {"ph": "X", "cat": "kernel", "name": "k", "ts": ts, "dur": dur, "pid": 0, "tid": 7,
            "args": {"correlation": corr}}


def _flow(corr, launch_ts, kernel_ts):
    return [{"ph": "s", "cat": "ac2g", "id": corr, "ts": launch_ts, "pid": 1, "tid": 1},
            {"ph": "f", "cat": "ac2g", "id": corr, "ts": kernel_ts, "pid": 0, "tid": 7}]


def _two_steps():
    events = []
    for base in (0, 100):   # two steps of 100 us: schedule 0-10, execute 10-90 (walk 50-60), 90-100 outside
        events += [_scope("engine: schedule", base, 10), _scope("engine: execute_model", base + 10, 80),
                   _scope("bole: walk", base + 50, 10)]
        events += [_kernel(base + 20, 30, base + 1)] + _flow(base + 1, base + 12, base + 20)
        events += [_kernel(base + 60, 20, base + 2)] + _flow(base + 2, base + 55, base + 60)
    events.append(_scope("other thread", 0, 500, tid=2))
    return events


def test_idle_and_busy_time_by_scope(tmp_path):
    gaps = _module()
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _two_steps()}, f)
    result = gaps.analyze(gaps.load(path))
    assert result["steps"] == 2
    # window 0..190 us (the last scope ends at 190): 95 us per step
    assert result["wall_ms_per_step"] == pytest.approx(0.095)
    assert result["gpu_busy_ms_per_step"] == pytest.approx(0.050)
    idle = result["gpu_idle_ms_per_step_by_scope"]
    # per step: schedule 10, execute 10 (10-20) + 0 (50-60 is walk) , walk 10, outside 10 (90-100; once only)
    assert idle["engine: schedule"] == pytest.approx(0.010)
    assert idle["engine: execute_model"] == pytest.approx(0.010 + 0.010)   # 10-20 and 80-90
    assert idle["bole: walk"] == pytest.approx(0.010)
    assert idle["(no scope)"] == pytest.approx(0.005)
    busy = result["gpu_ms_per_step_by_launching_scope"]
    assert busy == {"engine: execute_model": pytest.approx(0.030), "bole: walk": pytest.approx(0.020)}
    assert "GPU idle while the host runs" in gaps.report(result)


def test_per_step_lines():
    gaps = _module()
    first, second = gaps.per_step(_two_steps())
    assert (first["wall_ms"], first["gpu_busy_ms"]) == (pytest.approx(0.1), pytest.approx(0.05))
    assert first["gpu_idle_ms_by_scope"] == {"engine: schedule": pytest.approx(0.01),
                                             "engine: execute_model": pytest.approx(0.02),
                                             "bole: walk": pytest.approx(0.01), "(no scope)": pytest.approx(0.01)}
    assert second["wall_ms"] == pytest.approx(0.09)   # the last step ends with the last scope
    lines = gaps.step_lines(_two_steps())
    assert len(lines) == 2
    assert lines[0].startswith("step 0: wall 0.10 ms, GPU busy 0.05 ms; idle: ") and "bole: walk 0.01" in lines[0]


def test_a_trace_without_scopes_is_refused():
    gaps = _module()
    with pytest.raises(SystemExit, match="no GPU activity or no host scopes"):
        gaps.analyze([_kernel(0, 1, 1)])


def test_kernel_classes():
    gaps = _module()
    cases = {"nvjet_sm90_tst_192x24_64x7_2x1_v_bz_TNT": "gemm", "_tree_gdn_verify_kernel": "gdn",
             "fused_recurrent_gated_delta_rule_fwd_kernel": "gdn", "_commit_conv_kernel": "commit/kv move",
             "_tree_conv_kernel": "conv1d", "_compact_kernel": "commit/kv move", "_tree_attn_kernel": "attention",
             "void flash::FlashAttnFwdSm90<...>": "attention", "_quota_select_kernel": "tree bookkeeping",
             "void at::native::bitonicSortKVInPlace<-2>": "sort/top-k",
             "triton_red_fused__to_copy_add_fused_add_rms_norm_3": "inductor",
             "Memcpy HtoD (Pinned -> Device)": "copy/fill", "something_new": "other"}
    assert {name: gaps.kernel_class(name) for name in cases} == cases


def test_gpu_time_by_scope_and_kernel_class(tmp_path):
    gaps = _module()
    events = _two_steps()
    names = iter(["nvjet_gemm", "_tree_attn_kernel"] * 2)
    for e in events:
        if e.get("cat") == "kernel":
            e["name"] = next(names)
    result = gaps.analyze(events)
    assert result["gpu_ms_per_step_by_scope_and_kernel_class"] == {
        "engine: execute_model | gemm": pytest.approx(0.030), "bole: walk | attention": pytest.approx(0.020)}
    assert "| engine: execute_model | gemm | 0.030 |" in gaps.report(result)
