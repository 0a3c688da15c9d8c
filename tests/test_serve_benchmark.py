"""The online serving benchmark (``benchmarks/serve.py``).

* its CPU smoke run: vLLM's OpenAI server on the tiny Qwen3.5 for ``ar`` and ``bole``, vLLM's serving client at
  rates 1, 2 and inf; every row complete, the metrics there and positive, Bole accepting more than one token per
  step, the table printed;
* the tokenizer it builds for a config-only model (the 9B shape: 248320 tokens, no tokenizer files): vLLM's
  random dataset makes prompts of exactly the asked lengths with it, without the special token ids;
* configuration parsing and the comparison against the best chain, without a server.
"""

import json
import math
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import serve  # noqa: E402
from vllm_bole.worker.step_profile import STEP_KINDS  # noqa: E402

SHAPE_9B = ROOT / "benchmarks/models/qwen3.5-9b-shape/config.json"


@pytest.mark.vllm
def test_smoke(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("VLLM_BOLE_SLOW_STEP_MS", "60000")   # the step times by kind, no slow steps
    out = tmp_path / "serve.json"
    t0 = time.monotonic()
    data = serve.run(["--smoke", "--out", str(out), "--log-dir", str(tmp_path / "logs")])
    wall = time.monotonic() - t0
    printed = capsys.readouterr().out
    assert json.loads(out.read_text())["rows"] == data["rows"]
    assert data["ok"], printed[-3000:]
    assert data["command"] == "python3 benchmarks/serve.py --smoke --out " + str(out) + " --log-dir " + \
        str(tmp_path / "logs")
    assert data["config_order"] == ["ar", "bole"] and data["bole_configs"] == ["bole"]
    assert data["workload"]["request_rates"] == ["1", "2", "inf"]

    rows = {(r["config"], r["rate"]): r for r in data["rows"]}
    assert set(rows) == {(c, r) for c in ("ar", "bole") for r in ("1", "2", "inf")}
    for (config, rate), row in rows.items():
        n = row["num_prompts"]
        assert n == 6 and row["completed"] == n and row["failed"] == 0 and not row["errors"], row
        assert row["total_output_tokens"] == n * 32, row
        # vLLM's random prompts decode and re-encode: with the tiny BPE tokenizer a prompt may gain a token.
        assert abs(row["total_input_tokens"] - n * 32) <= n, row
        for key in ("ttft", "tpot", "itl", "e2el"):
            for stat in ("mean", "p50", "p90", "p99"):
                assert row[f"{key}_{stat}_ms"] > 0, (config, rate, key, stat)
        assert row["output_throughput"] > 0 and row["request_throughput"] > 0 and row["duration"] > 0
        assert row["ok"]
        # The server's phases of the rate's requests: the client's TTFT holds the queue and the prefill.
        assert row["queue_mean_ms"] >= 0 and row["prefill_mean_ms"] > 0 and row["decode_mean_ms"] > 0, row
        assert row["queue_mean_ms"] + row["prefill_mean_ms"] <= row["ttft_mean_ms"], row
        if config == "bole":
            assert row["spec_decode_acceptance_length"] > 1.0, row
            assert row["spec_decode_num_drafts"] > 0
            # Every rate's steps, its last ones included (logged at serve.py's one-token request after it).
            times = row["step_times"]
            assert times and set(times) <= set(STEP_KINDS) and row["slow_steps"] is None, row
            # Trees beside prompts (arrivals while others decode) draft before the walk too.
            assert "mixed_late" not in times, times
            steps = sum(t["steps"] for t in times.values())
            assert row["spec_decode_num_drafts"] / n <= steps <= 4 * row["spec_decode_num_drafts"], row
        else:
            assert row["spec_decode_acceptance_length"] is None and row["step_times"] is None
    print("bole step kinds:", {r: sorted(rows[("bole", r)]["step_times"]) for r in ("1", "2", "inf")})
    # Requests arrive at the rate (all at once at inf: faster than at 2 req/s).
    assert rows[("ar", "1")]["request_throughput"] < rows[("ar", "inf")]["request_throughput"]

    bole, ar = data["configs"]["bole"], data["configs"]["ar"]
    assert "--speculative-config" not in ar["server_cmd"]
    spec = json.loads(bole["server_cmd"][bole["server_cmd"].index("--speculative-config") + 1])
    assert spec["method"] == "bole" and spec["synthetic_acceptance"]["rates"]
    assert bole["start_s"] > 0 and bole["warmup"]["completed"] == 3    # the smoke's 2 at rate inf, then 1 alone
    assert bole["warmup"]["loads"] == [[2, 0], [1, 1]]

    assert [c["rate"] for c in data["comparison"]] == ["1", "2", "inf"]
    for comp in data["comparison"]:
        assert comp["baseline"] == "ar" and comp["bole_tpot_ratio"] > 0 and comp["bole_tok_s_ratio"] > 0

    # The table: a header, one line per rate with both configurations and Bole's ratios.
    assert "| rate | ar TPOT p50 ms | ar tok/s | bole TPOT p50 ms | bole tok/s | bole TPOT / ar |" in printed
    for rate in ("1", "2", "inf"):
        line = next(ln for ln in printed.splitlines() if ln.startswith(f"| {rate} | "))
        assert line.count("×") == 2 and "–" not in line, line
    assert "serve.py: 6 rows, all complete" in printed
    print(f"smoke: {wall:.0f} s")


def test_synthetic_tokenizer(tmp_path):
    """The 9B shape's tokenizer: every id a word, the config's special ids special; vLLM's random dataset makes
    prompts of exactly the asked length that decode and re-encode to themselves."""
    from vllm.benchmarks.datasets.datasets import RandomDataset
    from vllm.tokenizers import get_tokenizer

    config = json.loads(SHAPE_9B.read_text())
    path = serve.synthetic_tokenizer(config, cache_dir=tmp_path)
    assert serve.synthetic_tokenizer(config, cache_dir=tmp_path) == path  # cached
    tok = get_tokenizer(path)
    assert tok.vocab_size == len(tok) == 248320
    text, top = config["text_config"], config
    special = {text["eos_token_id"], text["pad_token_id"], top["image_token_id"], top["video_token_id"],
               top["vision_start_token_id"], top["vision_end_token_id"]}
    assert set(tok.all_special_ids) == special
    assert tok.decode([0, 248319]) == "t0 t248319"
    assert tok.encode("t5 t7  t248319\nt0", add_special_tokens=False) == [5, 7, 248319, 0]
    assert tok.num_special_tokens_to_add() == 0
    assert tok.encode("some real text", add_special_tokens=False) == [0, 0, 0]  # one token per word

    requests = RandomDataset(random_seed=0).sample(tokenizer=tok, num_requests=4, input_len=300, output_len=8)
    for req in requests:
        ids = tok.encode(req.prompt, add_special_tokens=False)
        assert req.prompt_len == len(ids) == 300 and not special & set(ids)
        assert tok.decode(ids) == req.prompt


def test_configs_and_flags():
    opts = serve.build_parser().parse_args([
        "--configs", 'ar,mtp3,bole,bole:{"budget_rule": "decode", "budget_table": null},bole_sync,mine',
        "--variant", 'mine={"topk": 2, "async_scheduling": true}', "--request-rates", "inf,2,1"])
    assert opts.request_rates == [1, 2, math.inf]
    names = serve.config_names(opts)
    assert names == ["ar", "mtp3", "bole", 'bole:{"budget_rule": "decode", "budget_table": null}', "bole_sync",
                     "mine"]
    assert serve.config_setup("ar", opts, True) == (None, [], None)
    spec, flags, note = serve.config_setup("mtp3", opts, True)
    assert spec == {"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
                    "synthetic_acceptance_rates": opts.rates[:3]} and not flags and note is None
    spec, _, note = serve.config_setup("mtp3", opts, False)  # CPU: vLLM's sampler has no synthetic mode
    assert "rejection_sample_method" not in spec and "CPU" in note
    bole, flags, _ = serve.config_setup("bole", opts, True)
    assert bole == {"method": "bole", "budget_table": opts.budget_table, "synthetic_acceptance": {
        "rates": opts.rates, "sibling_rates": opts.sibling_rates, "seed": 0,
        "draft_vocab_coverage": opts.draft_vocab_coverage}} and flags == []   # draft_vocab "auto"
    spec, _, _ = serve.config_setup(names[3], opts, True)
    assert spec["budget_rule"] == "decode" and spec["budget_table"] is None
    assert serve.config_setup("bole_sync", opts, True)[1] == ["--no-async-scheduling"]
    spec, flags, _ = serve.config_setup("mine", opts, True)
    assert spec["topk"] == 2 and flags == ["--async-scheduling"]
    with pytest.raises(SystemExit):
        serve.config_names(serve.build_parser().parse_args(["--configs", "ar,nonsense"]))


def _row(config, rate, tpot, tok_s, ok=True):
    return {"config": config, "rate": rate, "num_prompts": 4, "tpot_p50_ms": tpot, "output_throughput": tok_s,
            "ok": ok}


def test_comparison_against_best_chain():
    rows = [_row("ar", "1", 10.0, 100.0), _row("mtp1", "1", 6.0, 150.0), _row("mtp3", "1", 5.0, 140.0),
            _row("bole", "1", 4.0, 160.0),
            _row("ar", "inf", 20.0, 900.0), _row("mtp1", "inf", 12.0, 1200.0), _row("mtp3", "inf", 1.0, 10.0, False),
            _row("bole", "inf", 15.0, 1500.0)]
    comps = serve.comparisons(rows, {"bole"})
    one, inf = comps
    assert (one["best_tpot_config"], one["best_tok_s_config"]) == ("mtp3", "mtp1")
    assert one["bole_tpot_ratio"] == pytest.approx(0.8) and one["bole_tok_s_ratio"] == pytest.approx(160 / 150)
    # A failed row is no baseline.
    assert (inf["best_tpot_config"], inf["best_tok_s_config"]) == ("mtp1", "mtp1")
    assert inf["bole_tpot_ratio"] == pytest.approx(1.25) and inf["bole_tok_s_ratio"] == pytest.approx(1.25)
    table = serve.markdown(rows, ["ar", "mtp1", "mtp3", "bole"], {"bole"}, comps)
    assert "| 1 | 10.00 | 100.0 | 6.00 | 150.0 | 5.00 | 140.0 | 4.00 | 160.0 | mtp3 / mtp1 | 0.80× | 1.07× |" in table
    assert "1.00 (failed)" in table


def test_merge_keeps_other_configs():
    """A later invocation of the same workload replaces its own configurations' rows and keeps the others'."""
    previous = {"configs": {"ar": {"run": "a"}, "bole": {"run": "a"}}, "config_order": ["ar", "bole"],
                "bole_configs": ["bole"], "rows": [_row("ar", "1", 10.0, 100.0), _row("bole", "1", 9.0, 110.0)]}
    rows, configs, order, boles = serve.merge(previous, {"mtp3": {"run": "b"}, "bole": {"run": "b"}},
                                              [_row("mtp3", "1", 6.0, 150.0), _row("bole", "1", 4.0, 160.0)],
                                              {"bole"})
    assert order == ["ar", "mtp3", "bole"] and boles == {"bole"}
    assert configs["ar"]["run"] == "a" and configs["bole"]["run"] == "b"
    assert sorted((r["config"], r["tpot_p50_ms"]) for r in rows) == [("ar", 10.0), ("bole", 4.0), ("mtp3", 6.0)]
    assert serve.merge({}, {"bole_x": {}, "mtp1": {}, "ar": {}}, [], {"bole_x"})[2] == ["ar", "mtp1", "bole_x"]


def test_details_show_each_requests_share_of_a_step():
    """Nodes verified and tokens accepted per request per step (vLLM counts one draft per request per step): a
    chain's drafts are its k, Bole's what its budget gave each request."""
    row = {"config": "bole", "rate": "32", "num_prompts": 64, "completed": 64, "spec_decode_num_drafts": 4907,
           "spec_decode_draft_tokens": 15714, "spec_decode_accepted_tokens": 11537}
    table = serve.details_markdown([row, {**row, "config": "ar", "spec_decode_num_drafts": None,
                                          "spec_decode_draft_tokens": None, "spec_decode_accepted_tokens": None}],
                                   ["ar", "bole"])
    lines = table.splitlines()
    assert lines[0].endswith("| acceptance length | drafts / accepted per request-step | budgets by the throughput "
                             "rule (graphs) | kernels compiled |")
    assert "| TTFT p50 / p99 ms | queue / prefill mean ms |" in lines[0]
    assert lines[2].startswith("| ar | 32 |") and lines[2].endswith("| – / – | – | – |")
    assert lines[3].startswith("| bole | 32 |") and lines[3].endswith("| 3.20 / 2.35 | – | – |")
    row["bole_budget_rule"] = {"steps": 300, "by_rule": 0.25}
    assert serve.details_markdown([row], ["bole"]).endswith("| 3.20 / 2.35 | 25% of 300 steps | – |")
    row["bole_budget_rule"] |= {"graphs_captured": 4, "capture_ms": 310}
    row["kernel_compiles"] = {}
    assert serve.details_markdown([row], ["bole"]).endswith(
        "| 3.20 / 2.35 | 25% of 300 steps; 4 graphs captured (310 ms) | 0 |")


def test_phase_means_from_vllms_histograms():
    """Queue, prefill and decode means of the requests that ended each phase between two reads of /metrics, from
    vLLM's histograms summed over their label sets; None where no request ended it."""
    def metrics(queue, prefill, n, decode_n):
        return "\n".join([
            "# HELP vllm:request_queue_time_seconds Histogram of time spent in WAITING phase for request.",
            f'vllm:request_queue_time_seconds_sum{{engine="0",model_name="m"}} {queue}',
            f'vllm:request_queue_time_seconds_count{{engine="0",model_name="m"}} {n}',
            'vllm:request_queue_time_seconds_bucket{engine="0",le="0.3",model_name="m"} 1.0',
            f'vllm:request_prefill_time_seconds_sum{{engine="0",model_name="m"}} {prefill / 2}',
            f'vllm:request_prefill_time_seconds_sum{{engine="1",model_name="m"}} {prefill / 2}',
            f'vllm:request_prefill_time_seconds_count{{engine="0",model_name="m"}} {n}',
            f'vllm:request_decode_time_seconds_count{{engine="0",model_name="m"}} {decode_n}',
            f'vllm:request_decode_time_seconds_sum{{engine="0",model_name="m"}} {decode_n * 2.0}',
            "vllm:request_queue_time_seconds_created 1.7e9"])

    before = serve.phase_totals(metrics(1.0, 2.0, 4, 4))
    assert before == {"queue": [1.0, 4.0], "prefill": [2.0, 4.0], "decode": [8.0, 4.0]}
    after = serve.phase_totals(metrics(1.5, 3.0, 14, 4))
    assert serve.phase_means(before, after) == {"queue_mean_ms": 50.0, "prefill_mean_ms": 100.0,
                                                "decode_mean_ms": None}
    assert serve.phase_means(None, after) == {"queue_mean_ms": None, "prefill_mean_ms": None,
                                              "decode_mean_ms": None}
    row = {"config": "bole", "rate": "8", "num_prompts": 64, "completed": 64, "ttft_p50_ms": 176.2,
           "ttft_p99_ms": 321.0, "queue_mean_ms": 12.4, "prefill_mean_ms": 151.0}
    assert "| 176 / 321 | 12 / 151 |" in serve.details_markdown([row], ["bole"])


def test_rule_share_reads_the_servers_budget_lines(tmp_path):
    """The steps of Bole's per-interval budget lines logged during a rate, and the share the throughput rule chose
    (weighted by steps); the start-up lines stay in the configuration's ``budget_log``."""
    text = "\n".join([
        "(EngineCore pid=1) INFO 12-05 16:48:29 [budget.py:61] Bole budget 'auto': t.json for M on GPU, batch sizes [1]",
        "(EngineCore pid=1) INFO 12-05 16:48:39 [budget.py:180] Bole budget: 300 steps in the last 10.0 s, 0% chosen "
        "by the throughput rule; 2.00 nodes per request, batch 60-64",
        "(EngineCore pid=1) INFO 12-05 16:48:49 [budget.py:180] Bole budget: 100 steps in the last 10.1 s, 100% chosen "
        "by the throughput rule; 4.00 nodes per request, batch 64-64; 3 CUDA graphs captured (212 ms)",
        "(EngineCore pid=1) INFO 12-05 16:48:59 [budget.py:180] Bole budget: 100 steps in the last 10.0 s, 0% chosen "
        "by the throughput rule; 4.00 nodes per request, batch 64-64; 2 CUDA graphs captured (90 ms)"])
    assert serve.rule_share(text) == {"steps": 500, "by_rule": 0.2, "graphs_captured": 5, "capture_ms": 302}
    assert serve.rule_share("\n".join(text.splitlines()[:2])) == {"steps": 300, "by_rule": 0.0,
                                                                  "graphs_captured": 0, "capture_ms": 0}
    assert serve.rule_share(text.splitlines()[0]) is None
    log = tmp_path / "server.log"
    log.write_text(text)
    assert serve._budget_lines(log) == ["Bole budget 'auto': t.json for M on GPU, batch sizes [1]"]


def test_warmup_and_slow_steps_read_from_the_server_log():
    text = ("INFO 12-06 23:24:55 [warmup.py:94] Bole warm-up: 127 requests (batch sizes 1,2,4,8,16,32,64, prompts of "
            "32 and 640 tokens) in 410 steps, 96 verification and 120 drafter CUDA graphs captured, in 41.5 s\n"
            "(Worker pid=1) WARNING 12-06 23:30:00 [step_profile.py:91] Bole slow step: 412 ms since the previous "
            "step began (previous: 3 requests, 18 tokens, 0 prefilling; ...)\n"
            "(Worker pid=1) WARNING 12-06 23:30:01 [step_profile.py:91] Bole slow step: 130 ms since the previous "
            "step began (previous: ...)\n")
    assert serve.warmup_of(text) == {"requests": 127, "steps": 410, "verify_graphs": 96, "drafter_graphs": 120,
                                     "s": 41.5}
    assert serve.slow_steps(text) == {"count": 2, "max_ms": 412}
    assert serve.warmup_of("no such line") is None and serve.slow_steps("") is None
    gpu = ("(EngineCore pid=976) INFO 12-07 05:56:57 [kernel_warmup.py:150] Bole warm-up: tree kernels launched in "
           "every variant of eager steps (GDN: 7, attention: 16, next tokens: 15) in 8.4 s\n" + text)
    assert serve.warmup_of(gpu) == {**serve.warmup_of(text), "kernel_variants_s": 8.4,
                                    "kernel_variants": {"GDN": 7, "attention": 16, "next tokens": 15}}


def test_step_times_summed_over_the_server_log():
    """The step-time lines of one rate add up by kind: steps summed, means weighted by steps, the longest kept;
    the mean tokens where every line of the kind has them."""
    text = ("(EngineCore pid=1) INFO 12-07 02:50:00 [step_profile.py:162] Bole step times: trees_early 30 steps, mean "
            "10.0 ms, max 14 ms, 40 tokens; mixed 5 steps, mean 30.0 ms, max 41 ms, 1100 tokens\n"
            "INFO 12-07 02:50:01 [loggers.py:1] Engine 000: Avg prompt throughput: 1.0 tokens/s\n"
            "(EngineCore pid=1) INFO 12-07 02:50:10 [step_profile.py:162] Bole step times: trees_early 10 steps, mean "
            "14.0 ms, max 20 ms, 80 tokens; capturing 1 steps, mean 250.0 ms, max 250 ms\n")
    assert serve.step_times(text) == {
        "trees_early": {"steps": 40, "mean_ms": 11.0, "max_ms": 20.0, "mean_tokens": 50},
        "mixed": {"steps": 5, "mean_ms": 30.0, "max_ms": 41.0, "mean_tokens": 1100},
        "capturing": {"steps": 1, "mean_ms": 250.0, "max_ms": 250.0, "mean_tokens": None}}
    assert serve.step_times("Bole slow step: 412 ms") is None
    assert serve._steps_brief(serve.step_times(text)) == ("trees_early 40 x 11.0 ms, mixed 5 x 30.0 ms, "
                                                          "capturing 1 x 250.0 ms")


def test_kernel_compiles_counted_from_the_jit_monitor():
    """vLLM's JIT monitor lines after the start, verbose (one per compilation) or not (the first per kernel)."""
    text = ("(EngineCore pid=1912) WARNING 12-07 06:01:28 [jit_monitor.py:132] Triton kernel JIT compilation during "
            "inference: eagle_prepare_next_token_padded_kernel (constexprs={BLOCK_SIZE_TOKENS=1, num_reqs=1}; "
            "signature={})\n"
            "(EngineCore pid=1912) WARNING 12-07 06:01:29 [jit_monitor.py:132] Triton kernel JIT compilation during "
            "inference: rejection_greedy_sample_kernel (constexprs={SYNTHETIC_MODE=True})\n"
            "(EngineCore pid=1912) WARNING 12-07 06:01:30 [jit_monitor.py:132] Triton kernel JIT compilation during "
            "inference: eagle_prepare_next_token_padded_kernel (constexprs={BLOCK_SIZE_TOKENS=4, num_reqs=1})\n"
            "WARNING 12-07 06:01:31 [jit_monitor.py:132] TileLang JIT compilation during inference: _tl_gemm. This "
            "causes a latency spike; consider extending warmup to cover this shape/config.\n"
            "(EngineCore pid=1912) INFO 12-07 05:56:02 [jit_monitor.py:79] Kernel JIT monitor activated; monitored JIT "
            "compilations during inference will use mode=warn.\n")
    assert serve.kernel_compiles(text) == {"eagle_prepare_next_token_padded_kernel": 2,
                                           "rejection_greedy_sample_kernel": 1, "_tl_gemm": 1}
    assert serve.kernel_compiles("Bole step times: mixed 1 steps, mean 2.0 ms, max 2 ms") == {}
    assert serve._compiles({}) == "0" and serve._compiles(None) == "–"
    assert serve._compiles(serve.kernel_compiles(text)) == ("4 (_tl_gemm, eagle_prepare_next_token_padded_kernel, "
                                                           "rejection_greedy_sample_kernel)")
