"""Budget calibration: B_ver from a curve, the table file, per-step lookup, budget "auto", and a sweep through
vLLM whose table an engine then serves with."""

import json
import logging
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from vllm_bole.calibration.drafter import max_shape_nodes, shape_parents
from vllm_bole.spec_decode.budget_table import (DEFAULT_AUTO_BUDGET, ModelBudgets, budget_from_curve, device_name,
                                         make_entry, model_fingerprint, read_table, select_model, write_table)
from vllm_bole.config import parse_bole_config
from vllm_bole.errors import BoleConfigError
from vllm_bole.spec_decode import budget as budget_mod
from vllm_bole.spec_decode.tree import DraftTree


def _model(hidden=4096, layers=32):
    return SimpleNamespace(hf_config=SimpleNamespace(architectures=["Qwen3_5ForConditionalGeneration"]),
                           hf_text_config=SimpleNamespace(hidden_size=hidden, num_hidden_layers=layers,
                                                          vocab_size=248320), dtype=torch.bfloat16)


def _entry(b, kv, curve, t_dec=10.0, eps=0.1, model=None, gpu=None):
    return make_entry(fingerprint=model_fingerprint(model or _model()), model="m", gpu=gpu or device_name(),
                      batch_size=b, kv_len=kv, epsilon=eps, t_dec_ms=t_dec,
                      points=[{"nodes": n, "t_ver_ms": t, "samples": 5, "kv_len_mean": kv} for n, t in curve],
                      tree={"shape": "beam", "topk": 4, "max_depth": 8}, device_timing="wall_clock")


def test_b_ver_is_the_largest_n_within_epsilon():
    points = [{"nodes": n, "t_ver_ms": t} for n, t in [(8, 10.2), (16, 10.9), (32, 11.2), (64, 10.95), (128, 14)]]
    assert budget_from_curve(points, 10.0, 0.1) == (64, False)  # a noisy dip above a miss still counts
    assert budget_from_curve(points, 10.0, 0.5) == (128, True)
    assert budget_from_curve(points, 10.0, 0.01) == (0, False)


def test_entry_ratios_and_sorted_points():
    e = _entry(4, 256, [(32, 12.0), (8, 10.5)])
    assert [p["nodes"] for p in e["points"]] == [8, 32]
    assert [p["ratio"] for p in e["points"]] == [1.05, 1.2]
    assert (e["b_ver"], e["limited_by_grid"]) == (8, False)


def test_write_merges_by_key(tmp_path):
    path = tmp_path / "t.json"
    write_table(path, [_entry(1, 256, [(8, 10.0)]), _entry(4, 256, [(8, 10.0)])])
    write_table(path, [_entry(4, 256, [(8, 10.0), (16, 10.5)]), _entry(4, 1024, [(8, 10.0)])])
    rows = read_table(path)
    assert [(e["batch_size"], e["kv_len"], e["b_ver"]) for e in rows] == [(1, 256, 8), (4, 256, 16), (4, 1024, 8)]
    path.write_text(json.dumps({"entries": []}))
    with pytest.raises(ValueError, match="not a vllm-bole-budget-table"):
        read_table(path)


def test_lookup_picks_the_next_larger_bucket():
    b = ModelBudgets.from_entries([
        {"fingerprint": "f", "gpu": "g", "batch_size": bs, "kv_len": kv, "b_ver": bv}
        for bs, kv, bv in [(1, 256, 32), (1, 2048, 24), (8, 256, 192), (8, 2048, 128), (32, 256, 96)]])
    assert b.lookup(1, 100) == 32 and b.lookup(1, 257) == 24 and b.lookup(1, 9999) == 24
    assert b.lookup(2, 256) == 192 and b.lookup(8, 1000) == 128
    assert b.lookup(64, 256) == 96 and b.lookup(64, 4096) == 96
    assert b.lookup(8, None) == 128  # context unknown: the smallest budget of the batch bucket


def test_select_model_by_gpu_and_fingerprint():
    small, big = _model(hidden=256, layers=4), _model()
    entries = [_entry(1, 256, [(8, 10.0)], model=small), _entry(1, 256, [(8, 10.0), (16, 10.0)], model=big),
               _entry(1, 256, [(8, 10.0)], gpu="NVIDIA H200")]
    chosen, _ = select_model(entries, device_name(), model_fingerprint(big))
    assert chosen.lookup(1, 256) == 16
    none, why = select_model(entries, device_name(), None)
    assert none is None and "2 models" in why
    none, why = select_model(entries, "NVIDIA A100", None)
    assert none is None and "NVIDIA A100" in why


@pytest.fixture
def fresh_tables():
    budget_mod.reload_budget_tables()
    yield
    budget_mod.reload_budget_tables()


def test_auto_budget_reads_the_table(tmp_path, fresh_tables):
    path = tmp_path / "t.json"
    write_table(path, [_entry(1, 256, [(8, 10.0), (32, 10.5), (64, 13.0)]),
                       _entry(16, 256, [(64, 10.0), (128, 10.8), (256, 12.0)])])
    cfg, _ = parse_bole_config({"method": "bole", "budget_table": str(path)})
    assert budget_mod.node_budget(cfg, 1, 300, _model()) == 32
    assert budget_mod.node_budget(cfg, 9, None) == 128  # the only model calibrated here
    assert budget_mod.node_budget(cfg, 64, 10, _model()) == 128
    fixed, _ = parse_bole_config({"method": "bole", "budget": 40})
    assert budget_mod.node_budget(fixed, 1) == 40


def test_step_rule_weighs_the_rest_of_the_step(tmp_path, fresh_tables):
    """budget_rule "step": N may cost eps of the whole plain step (T_dec + the rest) more than T_dec; with no
    rest measured yet, or a rest of 0, it is the calibrated B_ver."""
    path = tmp_path / "t.json"
    write_table(path, [_entry(16, 256, [(64, 10.0), (128, 10.8), (256, 12.0), (512, 16.0)])])
    cfg, _ = parse_bole_config({"method": "bole", "budget_table": str(path), "budget_rule": "step"})
    assert budget_mod.node_budget(cfg, 16, 300, _model()) == 128                 # no measurement: B_ver
    assert budget_mod.node_budget(cfg, 16, 300, _model(), rest_ms=0.0) == 128
    assert budget_mod.node_budget(cfg, 16, 300, _model(), rest_ms=10.0) == 256   # 12.0 <= 11 + 0.1 * 10
    assert budget_mod.node_budget(cfg, 16, 300, _model(), rest_ms=50.0) == 512   # 16.0 <= 11 + 0.1 * 50
    decode, _ = parse_bole_config({"method": "bole", "budget_table": str(path), "budget_rule": "decode"})
    assert budget_mod.node_budget(decode, 16, 300, _model(), rest_ms=50.0) == 128  # the rule "decode" ignores it
    # The calibrated forward between and beyond the points (N = 0: the plain decode step).
    assert budget_mod.verify_ms(cfg, 16, 0, 300, _model()) == pytest.approx(10.0)
    assert budget_mod.verify_ms(cfg, 16, 96, 300, _model()) == pytest.approx(10.4)
    assert budget_mod.verify_ms(cfg, 16, 32, 300, _model()) == pytest.approx(10.0)
    assert budget_mod.verify_ms(cfg, 16, 768, 300, _model()) == pytest.approx(20.0)
    fixed, _ = parse_bole_config({"method": "bole", "budget": 40})
    assert budget_mod.verify_ms(fixed, 16, 96) is None


def test_throughput_rule_applies_only_with_curves_to_choose_from(tmp_path, fresh_tables):
    """The default rule "throughput" is kept where a table holds T_ver curves for the model on this GPU; without
    a table, with B_ver alone, or for another model it becomes "decode" (it would pick B_ver anyway)."""
    path = tmp_path / "t.json"
    cfg, _ = parse_bole_config({"method": "bole", "budget_table": str(path)})
    assert cfg.budget_rule == "throughput"
    assert budget_mod.with_applicable_rule(cfg, _model()).budget_rule == "decode"           # no table
    write_table(path, [{**_entry(16, 256, [(64, 10.0)]), "points": []}])
    budget_mod.reload_budget_tables()
    assert budget_mod.with_applicable_rule(cfg, _model()).budget_rule == "decode"           # B_ver alone
    write_table(path, [_entry(16, 256, [(64, 10.0), (128, 10.8)])])
    budget_mod.reload_budget_tables()
    kept = budget_mod.with_applicable_rule(cfg, _model())
    assert kept is cfg and kept.budget_rule == "throughput"
    assert budget_mod.with_applicable_rule(cfg, _model(hidden=256)).budget_rule == "decode"  # another model
    step, _ = parse_bole_config({"method": "bole", "budget_table": str(path), "budget_rule": "step"})
    assert budget_mod.with_applicable_rule(step, _model()) is step
    fixed, _ = parse_bole_config({"method": "bole", "budget": 40})
    assert budget_mod.with_applicable_rule(fixed, _model()) is fixed and fixed.budget_rule == "decode"
    measured, _ = parse_bole_config({"method": "bole", "budget_table": "measured"})
    assert budget_mod.with_applicable_rule(measured, _model()) is measured   # no table: whole steps measured


def test_measured_budget_table(fresh_tables):
    """budget_table "measured": the start budget until the rule has measurements (never below one node a request
    nor above the most a request may carry), T_ver 0 for the step clock, then the rule's choice among the batch
    size's candidates; it needs the throughput rule."""
    cfg, _ = parse_bole_config({"method": "bole", "budget_table": "measured", "num_speculative_tokens": 4,
                                "topk": 2})
    assert [budget_mod.node_budget(cfg, b) for b in (1, 8, 200)] == [8, 64, 600]   # 128, 3 a request, within 8 B
    assert budget_mod.verify_ms(cfg, 8, 96, 300, _model()) == 0.0
    gain = {8: 10.0, 16: 14.0, 24: 15.0, 32: 15.5, 48: 15.8, 64: 16.0}.get
    assert budget_mod.node_budget(cfg, 8, rest_ms=10.0, tokens=gain) == 64                     # flat: the most
    assert budget_mod.node_budget(cfg, 8, rest_ms=lambda n: 10.0 + n / 8, tokens=gain) == 16  # 14 / 12 is best
    for rule in ("decode", "step"):
        with pytest.raises(BoleConfigError, match="budget_table 'measured' needs budget_rule 'throughput'"):
            parse_bole_config({"method": "bole", "budget_table": "measured", "budget_rule": rule})


def test_step_clock_averages_the_rest_of_tree_steps():
    """Per power-of-two batch bucket; a period counts when it is one step of one batch size, of trees only."""
    clock = budget_mod.StepClock()
    clock.tick(1.000, 4, True, 5.0)                 # the first tick only starts the clock
    assert clock.rest_ms(4) is None
    clock.tick(1.020, 4, True, 5.0)                 # 20 ms step, 5 of them the target forward
    assert clock.rest_ms(4) == pytest.approx(15.0)
    clock.tick(1.050, 4, False, 5.0)                # a step with a prefill in it: not counted
    clock.tick(1.060, 4, True, 5.0)                 # 10 ms: the average moves a fifth of the way
    assert clock.rest_ms(4) == pytest.approx(15.0 + 0.2 * (5.0 - 15.0))
    clock.tick(1.100, 8, True, 5.0)                 # the batch changed: that period is not one step of 8
    assert clock.rest_ms(8) is None and clock.rest_ms(4) == pytest.approx(13.0)
    clock.tick(1.130, 8, True, None)                # no calibrated forward: nothing to subtract from
    assert clock.rest_ms(8) is None
    clock.tick(1.150, 6, True, 5.0)                 # batch 6 shares the bucket of 8 (the change: no sample)
    clock.tick(1.175, 6, True, 5.0)
    assert clock.rest_ms(8) == pytest.approx(20.0) and clock.rest_ms(5) == pytest.approx(20.0)


def test_step_clock_fits_the_rest_against_the_tree_size():
    """rest = a + b * nodes/request over the recent steps: flat (the average) while the sizes hardly differ,
    the slope once steps of other sizes come, never a falling one; only tree steps of one batch size count."""
    clock = budget_mod.StepClock()
    assert clock.rest_model(16) is None
    t = 0.0
    clock.tick(t, 16, True, 5.0, nodes=64)
    for _ in range(30):                       # 4 nodes per request: rest 10 ms
        t += 0.015
        clock.tick(t, 16, True, 5.0, nodes=64)
    flat = clock.rest_model(16)
    assert flat(64) == pytest.approx(10.0) and flat(256) == pytest.approx(10.0)   # no spread: no slope
    assert clock.fit_summary(16)["slope_ms"] is None and clock.fit_summary(32) is None
    for _ in range(30):                       # 8 nodes per request: rest 14 ms (1 ms per node per request)
        t += 0.019
        clock.tick(t, 16, True, 5.0, nodes=128)
    fit = clock.rest_model(16)
    assert fit(64) == pytest.approx(10.0, abs=1e-6) and fit(128) == pytest.approx(14.0, abs=1e-6)
    summary = clock.fit_summary(16)
    assert summary["slope_ms"] == pytest.approx(1.0, abs=1e-3) and 4 < summary["nodes_per_request"] < 8, summary
    assert fit(256) == pytest.approx(22.0, abs=1e-6)          # extrapolated along the line
    # batch 9 shares the bucket of 16; the fit is per request: 72 / 9 = 8 nodes
    assert clock.rest_model(9)(72) == pytest.approx(14.0, abs=1e-6)
    t += 0.5
    clock.tick(t, 16, False, 5.0, nodes=16)   # a step with a prefill (and a long one): not counted
    t += 0.030
    clock.tick(t, 16, True, 5.0, nodes=None)  # counted in the average, not in the fit
    assert clock.rest_model(16)(128) == pytest.approx(14.0, abs=1e-6)

    falling = budget_mod.StepClock()          # more nodes, less rest (noise): no negative slope
    t = 0.0
    falling.tick(t, 4, True, 5.0, nodes=8)
    for nodes, rest in ([(8, 10.0)] * 5 + [(32, 6.0)] * 5) * 4:
        t += (5.0 + rest) / 1e3
        falling.tick(t, 4, True, 5.0, nodes=nodes)
    model = falling.rest_model(4)
    assert model(8) == pytest.approx(model(32)) and 6.0 < model(8) < 10.0
    assert falling.fit_summary(4)["slope_ms"] < 0
    # ... and, the sizes spread as they are, the clock still probes other sizes (a flat model favours the largest)
    assert any(falling.probe(4) for _ in range(budget_mod.StepClock.PROBE_EVERY))


def test_step_clock_leaves_out_steps_that_captured_a_graph():
    """A period in which a CUDA graph was captured (a new step shape: an eager warm-up and a capture) is not a
    step's cost: neither the average nor the fit sees it, and the next period counts again."""
    clock = budget_mod.StepClock()
    t = 0.0
    clock.tick(t, 16, True, 5.0, nodes=64)
    for _ in range(5):
        t += 0.015
        clock.tick(t, 16, True, 5.0, nodes=64)
    t += 0.200                                # 128 nodes, first seen: captured
    clock.tick(t, 16, True, 5.0, nodes=128, captured=True)
    assert clock.rest_ms(16) == pytest.approx(10.0) and clock.rest_model(16)(128) == pytest.approx(10.0)
    t += 0.019
    clock.tick(t, 16, True, 5.0, nodes=128)   # the same size replayed: counted
    assert clock.rest_ms(16) == pytest.approx(10.0 + 0.2 * (14.0 - 10.0))


def test_runner_clock_ticks_see_graph_captures():
    """The model runner's clock tick passes ``captured`` when its graph holders grew since the last tick (a
    verification, drafter level or whole-level graph), and not when they did not."""
    from types import SimpleNamespace

    from vllm_bole.worker.budget_policy import BudgetPolicy
    from vllm_bole.worker.drafting import Drafting
    from vllm_bole.worker.model_runner import BoleModelRunnerMixin

    ticks = []
    verify = SimpleNamespace(graphs={})
    beam = SimpleNamespace(graphs=SimpleNamespace(graphs={}))
    policy = BudgetPolicy.__new__(BudgetPolicy)
    policy.config, policy.model_config, policy._graphs = parse_bole_config({"method": "bole", "budget": 40})[0], None, 0
    policy.clock = SimpleNamespace(tick=lambda *a, **kw: ticks.append(kw["captured"]))
    runner = SimpleNamespace(
        _bole_graphs=verify, bole_drafter=SimpleNamespace(graphs=SimpleNamespace(graphs={}), beam=beam,
                                                           beams=lambda: [beam]),
        _bole_forest=SimpleNamespace(tree_only=True), bole_budget=policy)
    runner.bole_graph_counts = lambda: BoleModelRunnerMixin.bole_graph_counts(runner)
    drafting = Drafting(runner)
    drafting.last_nodes = 64
    tick = lambda: drafting.tick_clock(16, 300)   # noqa: E731
    tick()
    verify.graphs[(80, 16, 0, 8)] = 0
    tick()
    tick()
    beam.graphs.graphs[(16, 3, 0)] = 0
    tick()
    assert ticks == [False, True, False, True]
    assert BoleModelRunnerMixin.bole_graph_counts(runner) == (1, 1)


def test_step_clock_probes_while_the_slope_is_unknown():
    """While a bucket's sizes hardly differ, a run of PROBE_RUN budgets every PROBE_EVERY is one size smaller,
    then one larger; none before the first measurement or once the sizes spread, and a run once started ends."""
    clock = budget_mod.StepClock()
    assert clock.probe(16) == 0                     # nothing measured yet
    t = 0.0
    clock.tick(t, 16, True, 5.0, nodes=64)
    for _ in range(5):
        t += 0.015
        clock.tick(t, 16, True, 5.0, nodes=64)
    every, run = budget_mod.StepClock.PROBE_EVERY, budget_mod.StepClock.PROBE_RUN
    probes = [clock.probe(16) for _ in range(4 * every)]
    starts = [i for i, p in enumerate(probes) if p and (i == 0 or not probes[i - 1])]
    assert starts == [every - run + k * every for k in range(4)]
    assert [probes[i:i + run] for i in starts] == [[-1] * run, [1] * run, [-1] * run, [1] * run]
    assert sum(1 for p in probes if p) == 4 * run
    assert clock.probe(16) == 0
    clock.probe(16)
    while not clock.probe(16):                      # into the next run
        pass
    for nodes in [64] * 10 + [192] * 10:            # 4 and 12 nodes per request: spread
        t += 0.015
        clock.tick(t, 16, True, 5.0, nodes=nodes)
    assert [clock.probe(16) for _ in range(run - 1)] == [-1] * (run - 1)   # the run started ends
    assert not any(clock.probe(16) for _ in range(4 * every))


def test_step_clock_fits_only_steady_periods():
    """A period enters the fit only when the last STEADY ticks recorded one batch size and one size of trees
    (the host may measure a neighbour's step); a step with a prefill or a capture breaks the run too."""
    clock = budget_mod.StepClock()
    steady = budget_mod.StepClock.STEADY
    t = 0.0
    clock.tick(t, 16, True, 5.0, nodes=64)
    for _ in range(steady - 2):
        t += 0.015
        clock.tick(t, 16, True, 5.0, nodes=64)
    assert clock.rest_model(16) is None and clock.rest_ms(16) == pytest.approx(10.0)   # the average counts
    t += 0.015
    clock.tick(t, 16, True, 5.0, nodes=64)
    assert clock.rest_model(16)(64) == pytest.approx(10.0)
    # sizes that change every tick (a lone probe, or a lag that mixes sizes and periods) never reach the fit
    for nodes in [128, 64] * 10:
        t += 0.050
        clock.tick(t, 16, True, 5.0, nodes=nodes)
    assert clock.rest_model(16)(64) == pytest.approx(10.0) and clock.rest_model(16)(128) == pytest.approx(10.0)
    # a tree short of its quota now and then (64 or 63 nodes: within STEADY_TOL per request) stays one size
    for nodes in [64, 63, 64] * 2:
        t += 0.015
        clock.tick(t, 16, True, 5.0, nodes=nodes)
    model = clock.rest_model(16)
    assert model(64) == pytest.approx(10.0, abs=0.01) and model(128) == pytest.approx(10.0, abs=0.5)
    fitted = clock._fit[16][0]
    t += 0.015
    clock.tick(t, 16, True, 5.0, nodes=64)
    assert clock._fit[16][0] > fitted                 # counted
    for tree_only, captured in ((False, False), (True, True)):
        t += 0.015
        clock.tick(t, 16, True, 5.0, nodes=64)
        clock.tick(t + 0.1, 16, tree_only, 5.0, nodes=64, captured=captured)
        t += 0.1
        for _ in range(steady - 1):                 # still inside the broken window: left out
            t += 0.050
            clock.tick(t, 16, True, 5.0, nodes=64)
        assert clock.rest_model(16)(64) == pytest.approx(10.0)


def test_missing_table_uses_the_default_with_one_warning(tmp_path, fresh_tables, caplog):
    """8 nodes a request up to 384 a step, at least 128 a step and 3 a request (vLLM's MTP chain of 3)."""
    cfg, _ = parse_bole_config({"method": "bole", "budget_table": str(tmp_path / "none.json")})
    with caplog.at_level(logging.INFO, logger="vllm_bole.spec_decode.budget"):
        assert [budget_mod.node_budget(cfg, b) for b in (1, 8, 8, 16, 17, 32, 48, 64, 128, 129)] == \
            [128] * 4 + [136, 256, 384, 384, 384, 387]
    lines = [r for r in caplog.records if r.name == "vllm_bole.spec_decode.budget"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "none.json" in lines[0].getMessage() and "vllm-bole calibrate" in lines[0].getMessage()


def test_missing_table_for_a_moe_model_uses_its_own_default(tmp_path, fresh_tables, caplog):
    """A mixture-of-experts model: 8 nodes a request up to 128 a step, at least 32 a step and 3 a request (each
    node's token reads its own experts' weights, so the dense rule's 128-node floor is not free at batch 2-15)."""
    cfg, _ = parse_bole_config({"method": "bole", "budget_table": str(tmp_path / "none.json")})
    moe = _model()
    moe.hf_text_config.num_experts = 256
    with caplog.at_level(logging.INFO, logger="vllm_bole.spec_decode.budget"):
        assert [budget_mod.node_budget(cfg, b, model_config=moe) for b in (1, 2, 4, 8, 16, 32, 43, 64)] == \
            [32, 32, 32, 64, 128, 128, 129, 192]
    lines = [r for r in caplog.records if r.name == "vllm_bole.spec_decode.budget"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "up to 128 per step" in lines[0].getMessage() and "mixture-of-experts" in lines[0].getMessage()
    # a dense model keeps the dense rule; "measured" starts each batch size from the model's rule
    assert budget_mod.node_budget(cfg, 8, model_config=_model()) == 128
    measured, _ = parse_bole_config({"method": "bole", "budget_table": "measured"})
    assert budget_mod.node_budget(measured, 8, model_config=moe) == 64
    assert budget_mod.node_budget(measured, 8, model_config=_model()) == 128


@pytest.mark.parametrize("kind,moe", [("qwen3_5", False), ("qwen3_5_moe", True), ("qwen3_next", True)])
def test_moe_is_told_from_vllms_text_config(kind, moe):
    """``is_moe`` on the text config vLLM reads from the tiny models' checkpoints."""
    from vllm.transformers_utils.config import get_config, get_hf_text_config

    from vllm_bole.spec_decode.budget_table import is_moe
    from vllm_bole.testing.tiny_models import tiny_model_dir

    text = get_hf_text_config(get_config(tiny_model_dir(kind), trust_remote_code=False))
    assert is_moe(SimpleNamespace(hf_text_config=text)) is moe


def test_table_for_another_model_uses_the_default(tmp_path, fresh_tables, caplog):
    path = tmp_path / "t.json"
    write_table(path, [_entry(1, 256, [(8, 10.0)], model=_model(hidden=256, layers=4))])
    cfg, _ = parse_bole_config({"method": "bole", "budget_table": str(path)})
    with caplog.at_level(logging.WARNING, logger="vllm_bole.spec_decode.budget"):
        assert budget_mod.node_budget(cfg, 1, 10, _model()) == DEFAULT_AUTO_BUDGET
    assert "no entry for model" in caplog.text


def test_env_names_the_default_table(tmp_path, monkeypatch):
    from vllm_bole.spec_decode.budget_table import default_table_path

    monkeypatch.setenv("VLLM_BOLE_BUDGET_TABLE", str(tmp_path / "x.json"))
    cfg, _ = parse_bole_config({"method": "bole"})
    assert budget_mod.table_path(cfg) == tmp_path / "x.json" == default_table_path()


@pytest.mark.parametrize("shape", ["beam", "kary", "chain"])
def test_shapes_are_trees_within_depth(shape):
    for n in (1, 5, 12, 40):
        parents = shape_parents(shape, n, 3, 4)
        tree = DraftTree([0] * len(parents), parents, [1.0] * len(parents))
        assert len(parents) == min(n, max_shape_nodes(shape, 3, 4))
        assert all(p < i for i, p in enumerate(parents)) and max(tree.depths()) <= 4
    widths = {d: tree.depths().count(d) for d in set(tree.depths())}
    assert widths == {"beam": {1: 3, 2: 3, 3: 3, 4: 3}, "kary": {1: 3, 2: 9, 3: 27, 4: 1},
                      "chain": {1: 1, 2: 1, 3: 1, 4: 1}}[shape]


def test_bad_shape_names_the_field():
    with pytest.raises(ValueError, match="drafter_args.shape"):
        shape_parents("star", 3, 2, 2)


@pytest.mark.vllm
def test_calibrate_then_serve_auto_budget(tmp_path):
    """The CLI sweeps a tiny grid through vLLM and writes the table; an engine with budget "auto" then verifies
    exactly B_ver nodes per step."""
    from e2e_support import random_requests, run_engine
    from vllm_bole.testing.tiny_models import engine_kwargs, tiny_model_dir

    model = tiny_model_dir("qwen3_5")
    table, depth, topk = tmp_path / "budget.json", 3, 2
    spec = {"method": "bole", "num_speculative_tokens": depth, "topk": topk}
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_bole.cli", "calibrate", "--model", model, "--speculative-config",
         json.dumps(spec), "--engine-args", json.dumps(engine_kwargs("qwen3_5")), "--batch-sizes", "1,2",
         "--kv-lens", "8,24", "--nodes", "2,3,5,8", "--warmup", "1", "--steps", "2", "--epsilon", "1000",
         "--out", str(table), "--no-progress"], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "| B | KV | T_dec ms | B_ver |" in proc.stdout

    entries = read_table(table)
    assert sorted((e["batch_size"], e["kv_len"]) for e in entries) == [(1, 8), (1, 24), (2, 8), (2, 24)]
    for e in entries:
        cap = e["batch_size"] * depth * topk  # nodes B requests can carry
        assert [p["nodes"] for p in e["points"]] == [n for n in (2, 3, 5, 8) if n <= cap]
        assert all(p["samples"] == 2 and p["t_ver_ms"] > 0 for p in e["points"])
        assert all(p["kv_len_mean"] > e["kv_len"] for p in e["points"])  # the context grows during the sweep
        # (ratio: of the unrounded T_dec, to 4 decimals; a slow verification step under load makes it large)
        assert all(math.isclose(p["ratio"], p["t_ver_ms"] / e["t_dec_ms"], rel_tol=1e-3, abs_tol=1e-3)
                   for p in e["points"])
        assert (e["b_ver"], e["limited_by_grid"]) == (e["points"][-1]["nodes"], True)  # epsilon 1000: all fit
        assert e["gpu"] == device_name() and e["tree"] == {"shape": "beam", "topk": topk, "max_depth": depth}
    assert len({e["fingerprint"] for e in entries}) == 1

    # Serve with budget "auto" and the rule "decode": 2 requests drafting 6 nodes each are cut to the table's
    # B_ver(2) = 8 per step.
    b_ver = next(e["b_ver"] for e in entries if e["batch_size"] == 2 and e["kv_len"] == 24)
    assert b_ver == 8
    vocab = json.load(open(f"{model}/config.json"))["text_config"]["vocab_size"]
    engine = {"speculative_config": {**spec, "budget": "auto", "budget_table": str(table), "budget_rule": "decode",
                                     "drafter": "vllm_bole.calibration.drafter:FixedShapeDrafter",
                                     "drafter_args": {"nodes": depth * topk},
                                     "synthetic_acceptance": {"rates": [0.0], "sibling_rates": []}}}
    out = run_engine(tmp_path, "auto", {"model": model, "engine": engine,
                                        "requests": random_requests(vocab, [12, 20], max_tokens=12)})
    c = out["counters"]
    assert c["num_accepted_tokens"] == 0 and c["num_drafts"] > 0
    assert c["num_draft_tokens"] == b_ver * c["num_drafts"] // 2

    # budget_rule "step" serves from the same table; with epsilon 1000 every N fits under either rule, so the
    # runner's step clock and the step rule's lookup run without changing the budget.
    engine["speculative_config"]["budget_rule"] = "step"
    out = run_engine(tmp_path, "step", {"model": model, "engine": engine,
                                        "requests": random_requests(vocab, [12, 20], max_tokens=12)})
    c = out["counters"]
    assert c["num_drafts"] > 0 and c["num_draft_tokens"] == b_ver * c["num_drafts"] // 2

    # budget_rule "throughput" (the default with "auto"): the runner feeds its walks to the acceptance model and
    # picks N among the grid's points from B_ver up (nothing is ever accepted here, so every N yields the same
    # tokens and the cheapest one wins: which one depends on this machine's timings; the choice itself is tested
    # in test_acceptance_model.py). A table whose B_ver is 3 leaves it 3, 5 and 8 to choose from, never 2.
    write_table(table, [{**e, "b_ver": 3} for e in entries])   # the engine runs in its own process
    engine["speculative_config"].pop("budget_rule")
    out = run_engine(tmp_path, "throughput", {"model": model, "engine": engine,
                                              "requests": random_requests(vocab, [12, 20], max_tokens=12)})
    c = out["counters"]
    assert c["num_drafts"] > 0 and out["acceptance_steps"] > 0, out
    assert c["num_accepted_tokens"] == 0 and c["num_draft_tokens"] <= b_ver * c["num_drafts"] // 2
    assert c["num_draft_tokens"] >= 3 * c["num_drafts"] // 2   # B_ver, 3 nodes per step, at least
    # The scheduler's budget lines count every planned step, the nodes it gave and how many the rule chose.
    log = out["budget_log"]
    assert log["steps"] == sum(count for _, _, count in out["budgets"]), (log, out["budgets"])
    assert log["nodes"] == sum(min(n, b * depth * topk) * count for b, n, count in out["budgets"])
    assert log["requests"] == sum(b * count for b, _, count in out["budgets"])
    assert 0 < log["by_rule"] <= log["steps"], log

    # ... and under async scheduling, with the MTP drafter: the scheduler places each step's quotas before the
    # step runs, from the model runner's budget once that has a clock and acceptance measurements (the
    # calibrated B_ver before); the walks stay on the device and reach the acceptance model by copies.
    engine = {"speculative_config": {**engine["speculative_config"], "drafter": "mtp", "drafter_args": {}},
              "async_scheduling": True}
    out = run_engine(tmp_path, "async_throughput", {"model": model, "engine": engine, "cpu_async_scheduling": True,
                                                    "requests": random_requests(vocab, [12, 20], max_tokens=24)})
    assert out["scheduling"] == {"async_scheduling": True, "batch_queue": True, "scheduler": "BoleAsyncScheduler"}
    assert out["device_output_steps"] > 0 and out["acceptance_steps"] > 0, out
    print(f"async throughput: planned {out['budgets']}, runner's {out['async_budgets']}")
    given = {n for b, n, _ in out["async_budgets"] if b == 2}
    assert given and given <= {3, 5, 8}, out["async_budgets"]   # the runner's choices: the grid's N from B_ver
    # Steps of both requests drafted B_ver(2) = 3 nodes until the runner's budget came, then what it gave (an odd
    # budget whole: one request drafts one node more).
    planned = {n for b, n, _ in out["budgets"] if b == 2}
    assert 3 in planned and planned <= given | {3}, (out["budgets"], out["async_budgets"])
    assert out["stale_placeholders"] == 0 and out["counters"]["num_accepted_tokens"] == 0, out
    log = out["budget_log"]   # the scheduler's own choices: the runner's once it had them, B_ver before
    assert 0 < log["by_rule"] < log["steps"], log

    # The default rule in charge of real trees is lossless: the planted drafter (the true continuation in the
    # tree) with the table and no synthetic acceptance, scheduled synchronously (the runner picks each budget)
    # and asynchronously (the scheduler asks the runner), against vLLM without speculation. Two requests: batch 2
    # has the grid's 3, 5 and 8 nodes to choose from, so 2 per request at least (a depth-2 path fits).
    from e2e_support import assert_lossless, bole_engine, write_oracle

    requests = random_requests(vocab, [12, 20], max_tokens=40, seed=7)
    ref = run_engine(tmp_path, "ref", {"model": model, "requests": requests})
    write_oracle(tmp_path, requests, ref)
    for name, asynchronous in (("planted_sync", False), ("planted_async", True)):
        engine = bole_engine(tmp_path, name, depth=depth, topk=topk, budget="auto", max_num_seqs=2,
                             async_scheduling=asynchronous)
        engine["speculative_config"]["budget_table"] = str(table)
        out = run_engine(tmp_path, name, {"model": model, "engine": engine, "requests": requests,
                                          **({"cpu_async_scheduling": True} if asynchronous else {})})
        print(f"{name}: budgets {out['budgets']}, runner's {out['async_budgets']}, counters {out['counters']}")
        assert_lossless(ref, out, max_near_ties=2)
        assert out["acceptance_steps"] > 0, out                 # the rule had walks to go by
        assert {n for b, n, _ in out["budgets"] if b == 2} <= {3, 5, 8}, out["budgets"]
        assert out["counters"]["accepted_per_pos"][1] > 0, out["counters"]   # depth-2 paths accepted
    assert out["async_budgets"] and out["stale_placeholders"] == 0, out


def test_step_clock_leaves_out_stalls():
    """A period far past the average (a Triton JIT, a host pause: hundreds of ms) is not a step's cost: neither
    the average nor the fit sees it. Stalls in a row past ``STALL_RUN`` are the steps' cost again."""
    clock = budget_mod.StepClock()
    t = 0.0
    clock.tick(t, 16, True, 5.0, nodes=64)
    for nodes, rest in [(64, 10.0)] * 20 + [(128, 14.0)] * 20:   # 1 ms per node per request
        t += (5.0 + rest) / 1e3
        clock.tick(t, 16, True, 5.0, nodes=nodes)
    before = (clock.rest_ms(16), clock.rest_model(16)(64), clock.rest_model(16)(128))
    t += 0.800                                  # an 800 ms period of the size before it
    clock.tick(t, 16, True, 5.0, nodes=128)
    for _ in range(3):                          # the sizes it held, the rest they cost
        t += 0.019
        clock.tick(t, 16, True, 5.0, nodes=128)
    after = (clock.rest_ms(16), clock.rest_model(16)(64), clock.rest_model(16)(128))
    assert after[1:] == pytest.approx(before[1:], abs=0.3) and after[1] < after[2], (before, after)
    assert after[0] == pytest.approx(14.0, abs=0.5)
    assert clock.fit_summary(16)["slope_ms"] == pytest.approx(1.0, abs=0.05) and clock.fit_summary(16)["stalls"] == 1
    for _ in range(budget_mod.StepClock.STALL_RUN + 1):   # the steps got slower: a run of them counts
        t += 0.105
        clock.tick(t, 16, True, 5.0, nodes=128)
    assert clock.rest_ms(16) > 30.0 and clock.fit_summary(16)["stalls"] == 1 + budget_mod.StepClock.STALL_RUN
