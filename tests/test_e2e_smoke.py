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


def test_smoke_run_with_two_rounds(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    out = tmp_path / "e2e.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/e2e.py"), "--smoke", "--rounds", "2", "--configs", "mtp3,bole",
         "--out", str(out), "--log-dir", str(tmp_path / "logs"), "--budget-table", str(tmp_path / "table.json")],
        env=env, capture_output=True, text=True, timeout=1200)
    logs = "".join((tmp_path / "logs" / f"{n}.log").read_text()[-3000:] for n in ("mtp3", "bole")
                   if (tmp_path / "logs" / f"{n}.log").exists())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs
    configs = json.loads(out.read_text())["configs"]
    assert sorted(configs) == ["bole", "mtp3"], proc.stdout[-3000:] + logs
    for name, config in configs.items():
        assert sorted(config["batches"]) == ["1", "2"]
        for row in config["batches"].values():
            assert len(row["tok_s_rounds"]) == 2 and len(row["tok_s_runs"]) == 2, row   # one run per round
            assert row["tok_s"] > 0 and row["mean_accepted"] >= 1.0, row
    assert [line.split(":")[0] for line in proc.stdout.splitlines() if " turn " in line] == ["mtp3", "bole"] * 4
