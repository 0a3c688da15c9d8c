"""The prefix-caching benchmark (``benchmarks/prefix_cache.py``): its CPU smoke run, vLLM's OpenAI server on the
tiny Qwen3.5 with prefix caching for ``ar`` and ``bole``, multi-turn conversations sharing a system prompt.

Every request completes with all its tokens; Bole (verified against the model, greedy) produces ar's tokens; and
each later turn hits exactly as many cached tokens as ar's (every full block of the previous turn's context:
Bole keeps the last matching block, which vLLM's MTP chain computes again).
"""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import prefix_cache  # noqa: E402


@pytest.mark.vllm
def test_smoke(tmp_path, capsys):
    out = tmp_path / "prefix-cache.json"
    data = prefix_cache.run(["--smoke", "--out", str(out), "--log-dir", str(tmp_path / "logs")])
    printed = capsys.readouterr().out
    assert json.loads(out.read_text())["rows"] == data["rows"]
    assert data["ok"], printed[-3000:]
    assert "| ar |" in printed and "| bole |" in printed
    rows = {r["config"]: r for r in data["rows"]}
    assert set(rows) == {"ar", "bole"}
    for row in rows.values():
        assert row["completed"] == row["requests"] == 12 and not row["failed"] and row["complete_outputs"], row
        assert row["ttft_p50_ms"] > 0 and row["tpot_p50_ms"] > 0 and row["output_tok_s"] > 0
        # The responses' cached tokens are vLLM's hits: here every lookup is one request's.
        assert row["cached_tokens"] == row["prefix_cache_hits"] and row["prompt_tokens"] == row["prefix_cache_queries"]
    assert rows["ar"]["hit_rate_later_turns"] > 0.5, rows["ar"]
    # vLLM's speculative-decoding counters: Bole's trees verify several nodes per request and accept some
    assert (rows["ar"]["tokens_per_step"], rows["ar"]["nodes_per_request_step"]) == (1.0, 0.0), rows["ar"]
    assert rows["bole"]["tokens_per_step"] > 1.0 and rows["bole"]["nodes_per_request_step"] > 1.0, rows["bole"]
    # A near-tie of bf16 logits may change a conversation: at most one of four.
    assert rows["bole"]["same_conversations_as_ar"] >= 3, rows["bole"]

    ar, bole = (data["requests"][c] for c in ("ar", "bole"))
    same = {r["conversation"] for r in ar} - _diverged(ar, bole)
    later = [(a, b) for a, b in zip(ar, bole, strict=True) if a["turn"] > 0 and a["conversation"] in same]
    assert later
    for a, b in later:
        assert (a["conversation"], a["turn"], a["prompt_len"]) == (b["conversation"], b["turn"], b["prompt_len"])
        assert b["cached"] == a["cached"] > 0, (a, b)
    assert data["comparison"]["bole"]["hit_rate_points_vs_ar"] > -2.0, data["comparison"]
    _check_merge(data, tmp_path)


def _check_merge(data: dict, tmp_path: Path) -> None:
    """``--merge``: the run split into one file per configuration (as separate commands write them) merges back
    into its rows, requests and comparison; a file of another workload is refused."""
    paths = []
    for name in ("ar", "bole"):
        part = {**data, "rows": [r for r in data["rows"] if r["config"] == name],
                "configs": {name: data["configs"][name]}, "requests": {name: data["requests"][name]},
                "bole_configs": [n for n in data["bole_configs"] if n == name]}
        part["rows"] = [{k: v for k, v in r.items() if k != "same_conversations_as_ar"} for r in part["rows"]]
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(part))
    merged = prefix_cache.merge([str(p) for p in paths], tmp_path / "merged.json")
    assert merged["rows"] == data["rows"] and merged["comparison"] == data["comparison"]
    assert merged["requests"] == data["requests"] and [r["configs"] for r in merged["runs"]] == [["ar"], ["bole"]]
    other = json.loads(paths[1].read_text())
    other["workload"] = {**other["workload"], "turns": other["workload"]["turns"] + 1}
    paths[1].write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="another workload"):
        prefix_cache.merge([str(p) for p in paths], tmp_path / "merged.json")


def _diverged(ar: list[dict], bole: list[dict]) -> set[int]:
    """Conversations with an output that differs (its later prompts differ too)."""
    return {a["conversation"] for a, b in zip(ar, bole, strict=True) if a["output_sha1"] != b["output_sha1"]}


def test_workload_plan():
    """Every conversation starts with the shared system prompt; the lengths are the options'."""
    opts = prefix_cache.build_parser().parse_args(["--conversations", "3", "--turns", "4", "--system-len", "50",
                                                   "--first-len", "20", "--append-len", "7", "--output-len", "5"])
    system, convs = prefix_cache.plan(opts, 1024, {0, 1, 2}, seed=0)
    assert len(system) == 50 and len(convs) == 3
    assert all(len(c) == 4 and len(c[0]) == 20 and all(len(a) == 7 for a in c[1:]) for c in convs)
    assert not {t for c in convs for turn in c for t in turn} & {0, 1, 2}
    assert convs[0][0] != convs[1][0]   # each conversation its own first message
    assert prefix_cache.longest_context(opts) == 50 + 20 + 3 * (5 + 7) + 5
    assert prefix_cache.plan(opts, 1024, {0, 1, 2}, seed=0) == (system, convs)
