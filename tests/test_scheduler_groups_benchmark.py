"""``benchmarks/scheduler_groups.py`` at a small size: both groupings run, and the setting reaches the grouping."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import scheduler_groups  # noqa: E402


def test_both_groupings_schedule_prefills_and_decodes(tmp_path):
    out = tmp_path / "groups.json"
    assert scheduler_groups.main(["--requests", "4", "--prompt-len", "600", "--steps", "12", "--repeats", "1",
                                  "--out", str(out)]) == 0
    rows = {r["kv_cache_groups"]: r for r in json.loads(out.read_text())["rows"]}
    assert (rows["fewest_bytes"]["groups"], rows["vllm"]["groups"]) == (11, 4)
    for row in rows.values():
        assert row["decode_steps"] > 0 and row["prefill_steps"] > 0
        assert row["decode_step_ms"] > 0 and row["prefill_step_ms"] > 0
