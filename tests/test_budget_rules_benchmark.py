"""benchmarks/budget_rules.py: the budget rules in a closed loop over a table's measured forwards (no engine)."""

import json

import pytest

from e2e_support import load_benchmark
from vllm_bole.spec_decode.budget_table import write_table


def _entry(batch, points, b_ver):
    return {"fingerprint": "m", "gpu": "G", "batch_size": batch, "kv_len": 1024, "b_ver": b_ver, "epsilon": 0.1,
            "t_dec_ms": 7.0, "points": [{"nodes": n, "t_ver_ms": t} for n, t in points]}


def test_rules_side_by_side_on_a_table(tmp_path):
    """Each batch size of the table: the best candidate and, per rule, its share of that rate (probes included)
    and the sizes it settled on; the measured rule finds a size close to the best from its start."""
    script = load_benchmark("budget_rules")
    table = tmp_path / "t.json"
    knee = [(8, 7.0), (32, 7.1), (64, 7.3), (128, 7.8), (256, 12.0), (512, 20.0)]
    write_table(table, [_entry(1, knee[:3], 32), _entry(16, knee, 128)])
    out = script.main(["--table", str(table), "--gpu", "G", "--steps", "600", "--last", "200",
                       "--out", str(tmp_path / "r.json")])
    assert json.loads((tmp_path / "r.json").read_text()) == out
    rows = {r["batch_size"]: r for r in out["rows"]}
    assert set(rows) == {1, 16}
    for row in rows.values():
        for rule in ("table", "measured", "fixed"):
            assert 0.5 < row[rule]["share"] <= 1.0 + 1e-9, row
        assert row["measured"]["share"] >= 0.95, row
    assert rows[16]["fixed"]["settled"] == [128] and rows[1]["fixed"]["settled"] == [32]


def test_acceptance_reads_the_rates_as_synthetic_acceptance_does():
    """The closed loop's tokens per request: the rates are unconditional per depth (a chain of q nodes accepts
    1 + the first q rates, as vLLM's synthetic chain does), and a draft vocabulary's coverage scales depth d by
    coverage ** d."""
    script = load_benchmark("budget_rules")
    rates, sibs = (0.9, 0.8, 0.6), (0.0,)
    curve = script.acceptance_curve(rates, sibs)
    assert curve[:4] == pytest.approx([1.0, 1.9, 2.7, 3.3])
    c = 0.9
    assert script.acceptance_curve(rates, sibs, c)[:4] == pytest.approx(
        [1.0, 1 + c * 0.9, 1 + c * 0.9 + c * c * 0.8, 1 + c * 0.9 + c * c * 0.8 + c ** 3 * 0.6])
