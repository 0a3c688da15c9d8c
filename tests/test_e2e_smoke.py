"""``benchmarks/e2e.py --smoke`` end to end on CPU: the driver starts one engine process per configuration from
``benchmarks/`` (whose script names must not shadow a package vLLM imports), gives them their turns round by
round, and merges their results."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_run_with_two_rounds_and_a_calibration(tmp_path):
    """Three engines, two rounds per batch size; ``bole`` calibrates a fresh table in its first turn, after which
    both Bole engines run the default rule "throughput" (it needs the table's curves, which did not exist when
    they started)."""
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    out, names = tmp_path / "e2e.json", ("mtp3", "bole", "bole_sync")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/e2e.py"), "--smoke", "--rounds", "2", "--calibrate", "--configs",
         ",".join(names), "--out", str(out), "--log-dir", str(tmp_path / "logs"),
         "--budget-table", str(tmp_path / "table.json")],
        env=env, capture_output=True, text=True, timeout=1500)
    logs = "".join((tmp_path / "logs" / f"{n}.log").read_text()[-3000:] for n in names
                   if (tmp_path / "logs" / f"{n}.log").exists())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs
    data = json.loads(out.read_text())
    configs = data["configs"]
    assert sorted(configs) == sorted(names), proc.stdout[-3000:] + logs
    for name, config in configs.items():
        assert sorted(config["batches"]) == ["1", "2"]
        for row in config["batches"].values():
            assert len(row["tok_s_rounds"]) == 2 and len(row["tok_s_runs"]) == 2, row   # one run per round
            assert row["tok_s"] > 0 and row["mean_accepted"] >= 1.0, row
            # the run's phases: 16 new tokens take at least 4 steps of at most 4 tokens after the prefill's one
            phases = row["engine_steps"]
            assert phases["steps"] > phases["full_steps"] >= 1 and phases["full_step_ms"] > 0, phases
            assert phases["prefill_ms"] > 0 and phases["full_tok_s"] > 0 and phases["tail_ms"] >= 0, phases
    assert configs["bole"]["calibration"] and configs["bole"]["budget_rule"] == "throughput"
    assert configs["bole_sync"]["budget_rule"] == "throughput"
    for name in ("bole", "bole_sync"):   # what the rule weighed; no graphs on CPU, so no capture time
        for row in configs[name]["batches"].values():
            assert row["rule_estimates"] and all(e["tokens_per_ms"] > 0 and e["t_ver_ms"] > 0
                                                 for e in row["rule_estimates"]), row
            assert row["capture_ms_in_timed_run"] == [0.0, 0.0, 0.0, 0.0], row
    turns = [line.split(":")[0] for line in proc.stdout.splitlines() if " turn " in line]
    assert turns == ["bole", "mtp3", "bole_sync"] * 4, turns   # the calibrating engine first at every turn
