"""The configurations of ``benchmarks/e2e.py`` and ``benchmarks/serve.py`` (one implementation, e2e.py's), without
an engine: each kept name runs the settings it ran before the set was cut down, ``mtp<k>`` and ``mtp<k>_sync`` are
generated, ``--variant NAME=JSON`` sets keys over ``bole``, an unknown name fails with one line, and result files
that name configurations no longer offered still make their rows, tables and plot."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import e2e  # noqa: E402
import serve  # noqa: E402
from vllm_bole.spec_decode.synthetic import DEFAULT_RATES, DEFAULT_SIBLING_RATES  # noqa: E402

BOLE_SIZES = [1, 2, 4, *range(8, 256, 8), *range(256, 1025, 32)]   # the default batch sizes are among them
# What each kept Bole name ran before: (keys over bole's speculative config, the engine's async_scheduling),
# and whether it schedules synchronously on a GPU (where --calibrate runs).
BEFORE = {"bole": ({}, None, False),
          "bole_global": ({"selection": "global"}, None, True),
          "bole_step": ({"budget_rule": "step"}, None, True),
          "bole_vocab32k": ({"draft_vocab": 32768}, None, False),
          "bole_full_vocab": ({"draft_vocab": None}, None, False),
          "bole_decode_vocab32k": ({"budget_rule": "decode", "draft_vocab": 32768}, None, False),
          "bole_late": ({"early_drafting": False}, None, False),
          "bole_vllm_kv_groups": ({"kv_cache_groups": "vllm"}, None, False),
          "bole_cold": ({"warmup": False}, None, False),
          "bole_sync": ({}, False, True),
          "bole_vocab32k_sync": ({"draft_vocab": 32768}, False, True),
          "bole_measured": ({"budget_table": "measured"}, None, False)}


def _args(*argv):
    return e2e.parse_args([*argv, "--model", "/nonexistent"])


def _bole_spec(args) -> dict:
    return {"method": "bole", "num_speculative_tokens": 8, "topk": 4, "budget": "auto",
            "budget_table": args.budget_table,
            "synthetic_acceptance": {"rates": list(DEFAULT_RATES), "sibling_rates": list(DEFAULT_SIBLING_RATES),
                                     "seed": 0}}


def test_kept_names_run_the_same_settings():
    args = _args()
    assert args.configs == ["ar", "mtp1", "mtp2", "mtp3", "mtp4", "bole"]   # the default grid
    assert list(e2e.BOLE_VARIANTS) == [n for n in BEFORE if n != "bole"]
    for name, (keys, async_scheduling, synchronous) in BEFORE.items():
        kw = e2e.engine_kwargs(args, name)
        want = _bole_spec(args) | keys
        if keys.get("draft_vocab", "auto") is not None:   # synthetic acceptance pays for the subset
            want["synthetic_acceptance"] |= {"draft_vocab_coverage": e2e.DEFAULT_DRAFT_VOCAB_COVERAGE}
        assert kw["speculative_config"] == want, name
        assert kw.get("async_scheduling") == async_scheduling, name
        assert kw["compilation_config"]["cudagraph_capture_sizes"] == BOLE_SIZES, name
        assert e2e.schedules_synchronously(name) == synchronous, name
    for k in (1, 3, 4):
        for suffix, async_scheduling in (("", None), ("_sync", False)):
            kw = e2e.engine_kwargs(args, f"mtp{k}{suffix}")
            assert kw["speculative_config"] == {"method": "mtp", "num_speculative_tokens": k,
                                                "rejection_sample_method": "synthetic",
                                                "synthetic_acceptance_rates": list(DEFAULT_RATES[:k])}
            assert kw.get("async_scheduling") == async_scheduling
            assert kw["compilation_config"]["cudagraph_capture_sizes"] == sorted(
                {1, 4, 8, 16, 32, 64} | {b * (k + 1) for b in (1, 4, 8, 16, 32, 64)})
    kw = e2e.engine_kwargs(args, "ar")
    assert "speculative_config" not in kw and "async_scheduling" not in kw
    assert kw["compilation_config"]["cudagraph_capture_sizes"] == [1, 4, 8, 16, 32, 64]
    with pytest.raises(SystemExit, match="--rates: mtp8 needs 8 rates, got 7"):
        e2e.engine_kwargs(args, "mtp8")
    with pytest.raises(SystemExit, match="^--configs: unknown bole_global_step; allowed: ar, "):
        e2e.engine_kwargs(args, "bole_global_step")


def test_draft_vocab_coverage_reaches_the_synthetic_acceptance():
    """--draft-vocab-coverage goes to every configuration with a draft vocabulary, a variant's own key wins, and
    the engine's config check accepts the result."""
    from vllm_bole.config import parse_bole_config

    args = _args("--draft-vocab-coverage", "0.9", "--variant", 'low={"draft_vocab": 32768, "draft_vocab_coverage": 0.8}',
                 "--variant", 'full={"topk": 2, "draft_vocab": null}')
    coverage = lambda name: e2e.engine_kwargs(args, name)["speculative_config"]["synthetic_acceptance"].get(  # noqa: E731
        "draft_vocab_coverage")
    assert [coverage(n) for n in ("bole_vocab32k", "bole_decode_vocab32k", "low", "full", "bole_full_vocab", "bole")] \
        == [0.9, 0.9, 0.8, None, None, 0.9]   # bole: draft_vocab "auto"
    spec = e2e.engine_kwargs(args, "low")["speculative_config"]
    assert "draft_vocab_coverage" not in spec and spec["draft_vocab"] == 32768
    parse_bole_config(spec)
    opts = serve.build_parser().parse_args(["--configs", "bole_vocab32k", "--draft-vocab-coverage", "0.7"])
    spec, _, _ = serve.config_setup("bole_vocab32k", opts, on_gpu=True)
    assert spec["synthetic_acceptance"]["draft_vocab_coverage"] == 0.7


def test_smoke_drafts_from_half_the_tiny_vocabulary():
    args = _args("--smoke")
    e2e.apply_smoke(args)
    assert e2e.engine_kwargs(args, "bole_vocab32k_sync")["speculative_config"]["draft_vocab"] == 512
    assert "draft_vocab" not in e2e.engine_kwargs(args, "bole_sync")["speculative_config"]   # "auto": an eighth


def test_names_chains_and_run_order():
    assert [e2e.chain_k(n) for n in ("mtp1", "mtp8", "mtp3_sync", "mtp9", "mtp0", "mtp", "bole", "mtp3_async")] == \
        [1, 8, 3, None, None, None, None, None]
    assert [e2e.is_chain(n) for n in ("mtp2", "mtp2_sync", "ar")] == [True, False, False]
    assert e2e.config_names(" mtp8 ,mtp5_sync,bole,mtp8") == ["mtp8", "mtp5_sync", "bole"]
    variants = {"mine": {"topk": 2}}
    names = e2e.config_names("mine,mtp3_sync,bole_sync,ar,bole_global,mtp3,bole", variants)
    # e2e.py runs them in one order whatever the order given (the turns and the GPU of each follow it)
    assert e2e.run_order(names, variants) == ["ar", "mtp3", "bole", "bole_global", "bole_sync", "mine", "mtp3_sync"]
    args = _args("--configs", "bole_sync,mtp3,bole,mine,ar", "--variant", 'mine={"topk": 2}')
    assert args.configs == ["ar", "mtp3", "bole", "bole_sync", "mine"]


@pytest.mark.parametrize("configs", ["ar,bole_tput_vocab32k,mtp9", "bole_async", "bole_vocab32k_coarse", "",
                                     'bole:{"topk": 2}'])
def test_an_unknown_name_fails_with_one_line(configs):
    with pytest.raises(SystemExit) as info:
        _args("--configs", configs)
    message = str(info.value)
    assert "\n" not in message and message.startswith("--configs: ")
    assert "allowed: ar, mtp1..mtp8, bole, bole_global, bole_step, bole_vocab32k, bole_full_vocab, " \
           "bole_decode_vocab32k, bole_late, bole_vllm_kv_groups, bole_cold, bole_sync, bole_vocab32k_sync, " \
           "bole_measured, mtp1_sync..mtp8_sync (and names given by --variant" in message
    # serve.py: the same names, and its inline form
    with pytest.raises(SystemExit, match="mtp1_sync..mtp8_sync, bole:{JSON}"):
        serve.config_names(serve.build_parser().parse_args(["--configs", "ar,bole_step_vocab32k"]))


def test_the_script_prints_the_one_line():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/e2e.py"), "--configs", "ar,bole_global_step"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "--configs: unknown bole_global_step; allowed: ar, mtp1..mtp8, bole, bole_global, bole_step, bole_vocab32k, "
        "bole_full_vocab, bole_decode_vocab32k, bole_late, bole_vllm_kv_groups, bole_cold, bole_sync, "
        "bole_vocab32k_sync, bole_measured, mtp1_sync..mtp8_sync (and names given by --variant NAME=JSON)"]


def test_variant_keys_over_bole():
    assert e2e.parse_variant(' mine={"topk": 2, "budget_table": null}') == ("mine", {"topk": 2, "budget_table": None})
    for bad in ("mine", "mine=[1]", "mine={bad", '={"topk": 2}', 'a b={"topk": 2}', 'mtp3={"topk": 2}',
                'ar={"topk": 2}'):
        with pytest.raises(argparse.ArgumentTypeError):
            e2e.parse_variant(bad)
    variant = 'mine={"topk": 2, "budget_table": null, "selection": "global", "async_scheduling": false}'
    args = _args("--configs", "bole,mine", "--variant", variant, "--variant", 'bole_sync={"draft_vocab": 4096}')
    spec = e2e.engine_kwargs(args, "mine")["speculative_config"]
    want = _bole_spec(args)
    want["synthetic_acceptance"] |= {"draft_vocab_coverage": e2e.DEFAULT_DRAFT_VOCAB_COVERAGE}   # draft_vocab "auto"
    assert spec == want | {"topk": 2, "budget_table": None, "selection": "global"}
    assert e2e.engine_kwargs(args, "mine")["async_scheduling"] is False
    variants = dict(args.variant)
    assert e2e.is_bole("mine", variants) and not e2e.is_bole("mine") and not e2e.is_bole("mtp3", variants)
    assert e2e.schedules_synchronously("mine", variants)
    # a --variant of a named variant's name replaces its keys
    kw = e2e.engine_kwargs(args, "bole_sync")
    assert kw["speculative_config"]["draft_vocab"] == 4096 and "async_scheduling" not in kw
    with pytest.raises(SystemExit, match="unknown other"):
        _args("--configs", "bole,other", "--variant", variant)


def test_serve_takes_the_same_settings():
    opts = serve.build_parser().parse_args([
        "--configs", "ar,mtp3_sync,bole_vocab32k_sync,bole_late,mine", "--variant", 'mine={"async_scheduling": true}'])
    assert serve.config_names(opts) == ["ar", "mtp3_sync", "bole_vocab32k_sync", "bole_late", "mine"]
    spec, flags, _ = serve.config_setup("mtp3_sync", opts, True)
    assert spec["num_speculative_tokens"] == 3 and flags == ["--no-async-scheduling"]
    assert serve.config_setup("mtp3_sync", opts, False)[1] == ["--no-async-scheduling"]   # CPU: verified
    assert not serve.is_chain("mtp3_sync")   # not a baseline chain
    base = serve.config_setup("bole", opts, True)[0]
    for name, (keys, async_scheduling, _) in BEFORE.items():
        spec, flags, _ = serve.config_setup(name, opts, True)
        want = base | keys
        if keys.get("draft_vocab", "auto") is None:   # the full vocabulary: nothing to pay for
            want["synthetic_acceptance"] = {k: v for k, v in base["synthetic_acceptance"].items()
                                            if k != "draft_vocab_coverage"}
        assert spec == want, name
        assert flags == ([] if async_scheduling is None else ["--no-async-scheduling"]), name
    assert serve.config_setup("mine", opts, True) == (base, ["--async-scheduling"], None)


def _config(tok_s, **extra):
    return {"gpu": "G", "concurrency": 10.0, "batches": {"4": {"tok_s": tok_s, "budget": 64}}, **extra}


def test_results_with_configurations_no_longer_offered(tmp_path):
    """Rows, tables and the plot of a results file whose configurations include removed names (recorded by name
    only, as the test results above, or with their speculative config) and a --variant one (its keys recorded)."""
    configs = {"mtp3": _config(300.0), "mtp4_sync": _config(310.0), "bole": _config(330.0),
               "bole_vocab32k_coarse": _config(360.0), "bole_async": _config(340.0),
               "bole_vocab32k": _config(345.0),
               "bole_tput_vocab32k": _config(390.0, speculative_config={"method": "bole", "draft_vocab": 32768}),
               "wide": _config(420.0, speculative_config={"method": "bole", "topk": 8}, variant={"topk": 8})}
    [row] = e2e.build_rows(configs)
    assert row["mtp_best_k"] == 3 and row["mtp_sync_tok_s_by_k"] == {"4": 310.0}
    for name, tok_s in (("bole_vocab32k", 345.0), ("bole_vocab32k_coarse", 360.0), ("bole_async", 340.0),
                        ("bole_tput_vocab32k", 390.0), ("wide", 420.0)):
        assert row[f"{name}_tok_s"] == tok_s and row[f"{name}_speedup_vs_mtp"] == round(tok_s / 300.0, 3), name
    table = e2e.markdown([row], e2e.variant_keys(configs))
    assert "Bole with draft_vocab 32768 (bole_vocab32k):" in table and "Bole (bole_vocab32k_coarse):" in table
    assert "Bole with topk 8 (wide):" in table and "| 4 | 420 | – | 64 | 1.40× |" in table
    # the named variants first, in their order, then the others as they came
    titles = [line for line in table.splitlines() if line.startswith("Bole")]
    assert [t.rsplit("(", 1)[1] for t in titles] == ["bole_vocab32k):", "bole_vocab32k_coarse):", "bole_async):",
                                                     "bole_tput_vocab32k):", "wide):"]
    assert set(e2e.plot_series({"configs": configs})["speedup_vs_best_mtp"]) == {
        "bole", "bole_vocab32k_coarse", "bole_async", "bole_vocab32k", "bole_tput_vocab32k", "wide"}


@pytest.mark.parametrize("name", ["e2e.json", "e2e_h200.json"])
def test_stored_results_still_report(tmp_path, name):
    data = json.loads((ROOT / "benchmarks/results" / name).read_text())
    rows = e2e.build_rows(data["configs"])
    assert [r["B"] for r in rows] == [r["B"] for r in data["rows"]]
    for old, new in zip(data["rows"], rows):   # every field the file's rows hold, the same (an older file's
        old = {k: v for k, v in old.items() if k != "concurrency_bole"}   # had none without a "bole" row)
        assert {k: new.get(k) for k in old} == old
    table = e2e.markdown(rows, e2e.variant_keys(data["configs"]))
    assert all(f"({n})" in table for n in e2e.bole_results(data["configs"]) if n != "bole")
    e2e.steps_markdown(data["configs"])
    out = tmp_path / name
    out.write_text(json.dumps(data))
    assert e2e.main(["--plot-only", "--out", str(out)]) == 0
