"""benchmarks/e2e.py's rows and table: the best chain is picked among the async-scheduled MTP chains only, the
synchronous chains and Bole's step-rule configuration are reported beside it."""

import pytest

from e2e_support import load_benchmark


def _e2e():
    return load_benchmark("e2e")


def _config(tok_s, concurrency=10.0, **batch):
    return {"gpu": "G", "concurrency": concurrency, "batches": {"4": {"tok_s": tok_s, **batch}}}


def test_rows_pick_the_best_async_chain_and_report_the_rest():
    e2e = _e2e()
    configs = {"ar": _config(100.0, 160.0), "mtp3": _config(300.0, 60.0, mean_accepted=3.4),
               "mtp4": _config(280.0, 50.0, mean_accepted=3.9), "mtp4_sync": _config(900.0, 50.0),
               "bole": _config(330.0, 140.0, mean_accepted=5.5, budget=64, draft_tokens_per_step=16.0),
               "bole_step": _config(450.0, 140.0, mean_accepted=6.1, budget=96),
               "bole_global": _config(600.0, 140.0, mean_accepted=5.2, budget=64),
               "bole_vocab32k_sync": _config(500.0, 140.0, mean_accepted=5.6, budget=96)}
    [row] = e2e.build_rows(configs)
    assert (row["mtp_best_k"], row["mtp_best_tok_s"], row["concurrency_mtp"]) == (3, 300.0, 60.0)
    assert row["mtp_tok_s_by_k"] == {"3": 300.0, "4": 280.0} and row["mtp_mean_accepted_by_k"] == {"3": 3.4, "4": 3.9}
    assert row["mtp_sync_tok_s_by_k"] == {"4": 900.0}   # a synchronous Bole configuration is not a chain
    assert (row["bole_vocab32k_sync_tok_s"], row["bole_vocab32k_sync_budget"]) == (500.0, 96)
    assert (row["speedup_vs_mtp"], row["speedup_vs_ar"]) == (1.1, 3.3)
    assert (row["bole_step_tok_s"], row["bole_step_budget"], row["bole_step_speedup_vs_mtp"]) == (450.0, 96, 1.5)
    table = e2e.markdown([row])
    assert "| 4 | 100 | 300 (k=3) | 330 | 5.50 | 64 | 1.10× | 3.30× |" in table
    assert "B=4: k=4 900" in table and "| 4 | 450 | 6.10 | 96 | 1.50× |" in table
    assert (row["bole_global_tok_s"], row["bole_global_speedup_vs_mtp"]) == (600.0, 2.0)
    assert 'selection "global" (bole_global)' in table and "| 4 | 600 | 5.20 | 64 | 2.00× |" in table


def test_rows_without_the_extra_configs_keep_the_issue_schema():
    e2e = _e2e()
    [row] = e2e.build_rows({"ar": _config(100.0), "mtp1": _config(150.0), "bole": _config(120.0, budget=8)})
    assert {"B", "ar_tok_s", "mtp_best_k", "mtp_best_tok_s", "bole_tok_s", "bole_mean_accepted", "speedup_vs_mtp",
            "speedup_vs_ar", "concurrency_ar", "concurrency_mtp", "concurrency_bole", "gpu"} <= set(row)
    assert not any(k.startswith(("bole_step", "bole_pr", "mtp_sync")) for k in row)
    assert "budget_rule" not in e2e.markdown([row]) and "async" not in e2e.markdown([row])


def test_graph_keys_by_kind_for_the_timed_runs_report():
    """The keys of the graphs a Bole runner holds, by kind (what the timed runs report as newly captured); none
    for an engine without Bole's graphs."""
    from types import SimpleNamespace

    e2e = _e2e()
    beam = SimpleNamespace(graphs={(16, 3, False): 0, (16, 4, True): 0})
    drafter = SimpleNamespace(graphs=SimpleNamespace(graphs={}), beam=SimpleNamespace(graphs=beam))
    runner = SimpleNamespace(_bole_graphs=SimpleNamespace(graphs={(80, 16, False): 0}), bole_drafter=drafter)
    keys = e2e._bole_graph_keys(runner)
    assert keys == {"verify": {(80, 16, 0)}, "draft": set(), "beam": {(16, 3, 0), (16, 4, 1)}}
    assert e2e._bole_graph_keys(SimpleNamespace()) == {}


def test_turn_lock_excludes_a_second_holder(tmp_path):
    """--turn-lock: the timed phase holds the file's lock, so another holder (step_profile.py) waits for it."""
    import fcntl

    e2e = _e2e()
    path = tmp_path / "turn.lock"
    with e2e._turn(str(path)):
        with open(path, "a") as other:
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                taken = True
            except BlockingIOError:
                taken = False
    assert not taken
    with open(path, "a") as other:   # released after the turn
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with e2e._turn(None):            # no path: nothing to take
        pass


def test_budget_overrides_rewrite_a_copy_of_the_table(tmp_path):
    """--budgets 16=96: the Bole engines read a copy of the calibration table whose batch-16 entries (every KV
    bucket) have that budget; the other entries and the measured curves are unchanged, the original untouched."""
    import argparse
    import json

    import pytest

    e2e = _e2e()
    assert e2e._budget_overrides("16=96, 32=192") == {16: 96, 32: 192}
    with pytest.raises(argparse.ArgumentTypeError):
        e2e._budget_overrides("16:96")
    entries = [{"batch_size": b, "kv_len": kv, "b_ver": 64, "points": [{"nodes": 64, "t_ver_ms": 7.0}]}
               for b in (1, 16) for kv in (256, 1024)]
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"format": "f", "version": 1, "entries": entries}))
    path = e2e.override_budgets(table, {16: 96}, tmp_path / "logs")
    got = json.loads(path.read_text())["entries"]
    assert [(e["batch_size"], e["kv_len"], e["b_ver"]) for e in got] == [(1, 256, 64), (1, 1024, 64), (16, 256, 96),
                                                                        (16, 1024, 96)]
    assert all(e["points"] == entries[0]["points"] for e in got)
    assert json.loads(table.read_text())["entries"] == entries
    with pytest.raises(SystemExit, match="batch sizes \\[8\\]"):
        e2e.override_budgets(table, {8: 96}, tmp_path / "logs")
    with pytest.raises(SystemExit, match="no calibration table"):
        e2e.override_budgets(tmp_path / "absent.json", {16: 96}, tmp_path / "logs")


def test_an_empty_budget_table_runs_bole_without_a_table(tmp_path):
    """--budget-table '': the Bole engines read a path in the log directory that holds no table (the table-less
    default), not the bundled H100 table; --budgets and --calibrate need a table."""
    import pytest

    e2e = _e2e()
    args = e2e.parse_args(["--budget-table", "", "--log-dir", str(tmp_path)])
    assert args.budget_table == str(tmp_path / e2e.NO_BUDGET_TABLE)
    assert e2e.parse_args([]).budget_table == e2e.DEFAULT_BUDGET_TABLE
    for extra in (["--budgets", "16=96"], ["--calibrate"]):
        with pytest.raises(SystemExit, match="need a table path"):
            e2e.parse_args(["--budget-table", "", *extra])


def test_calibration_runs_in_the_first_synchronous_bole_config_and_the_latest_is_reported(tmp_path):
    e2e = _e2e()
    assert e2e.calibrating_config(["mtp3", "bole", "bole_vocab32k_sync", "bole_sync"]) == "bole_vocab32k_sync"
    assert e2e.calibrating_config(["bole", "bole_late", "bole_global", "bole_step"]) == "bole_global"
    assert e2e.calibrating_config(["mtp3", "bole", "bole_vocab32k", "bole_decode_vocab32k"]) is None
    # a --variant configuration by its keys: budget_rule "step" schedules synchronously, async_scheduling true not
    variants = {"mine": {"budget_rule": "step"}, "fast": {"async_scheduling": True}}
    assert e2e.calibrating_config(["mtp3", "fast", "mine"], variants=variants) == "mine"
    assert e2e.calibrating_config(["mtp3", "bole"], smoke=True) == "bole"   # CPU: every engine is synchronous
    args = e2e.build_parser().parse_args([])
    out = tmp_path / "e2e.json"
    old = {"batch_size": 4, "kv_len": 256, "t_dec_ms": 5.0, "b_ver": 32, "epsilon": 0.1, "points": []}
    new = old | {"b_ver": 64}
    e2e.merge_and_write(out, {"bole": _config(1.0) | {"run": "2026-12-01T00:00:00Z", "calibration": [old]}}, args)
    data = e2e.merge_and_write(
        out, {"bole_vocab32k": _config(2.0) | {"run": "2026-12-03T00:00:00Z", "calibration": [new]}}, args)
    assert [e["b_ver"] for e in data["calibration"]] == [64]


def _fake_workers(e2e, tmp_path, batch_sizes, body: str, args: dict, rounds: int = 1) -> dict:
    """Processes that take turns as benchmark workers do (``worker_turns``), each logging the start and end of
    its turns to ``turns.log`` (``<name> <B>``, ``<name> <B>.<round>`` from the second round); ``body`` runs inside
    a turn (``name``, ``arg``, ``b`` and ``r`` defined), ``args``: the ``arg`` of each worker by name."""
    import subprocess
    import sys
    from pathlib import Path

    log = tmp_path / "turns.log"
    worker = (
        "import importlib.util, sys, time\n"
        "from pathlib import Path\n"
        f"spec = importlib.util.spec_from_file_location('e2e', {str(Path(e2e.__file__))!r})\n"
        "e2e = importlib.util.module_from_spec(spec); spec.loader.exec_module(e2e)\n"
        "e2e.POLL_S = 0.01\n"
        "name, arg = sys.argv[1], float(sys.argv[2])\n"
        f"for b, r in e2e.worker_turns(Path({str(tmp_path)!r}), name, {list(batch_sizes)!r}, {rounds}):\n"
        "    tag = f'{b}.{r}' if r else str(b)\n"
        f"    open({str(log)!r}, 'a').write(f'{{name}} {{tag}} start\\n')\n"
        + "".join(f"    {line}\n" for line in body.splitlines()) +
        f"    open({str(log)!r}, 'a').write(f'{{name}} {{tag}} end\\n')\n")
    e2e.POLL_S = 0.01
    return {name: subprocess.Popen([sys.executable, "-c", worker, name, str(arg)]) for name, arg in args.items()}


def test_turns_go_batch_size_by_batch_size_and_skip_a_worker_that_exited(tmp_path):
    """The timed phases interleave: at each batch size every configuration in turn, one at a time (each worker
    logs the start and end of its turns; no two overlap); a worker that exits mid-run is skipped, not waited on."""
    e2e = _e2e()
    procs = _fake_workers(e2e, tmp_path, [1, 4, 8], "if b == arg: sys.exit(3)\ntime.sleep(0.05)",
                          {"bole": 0, "mtp3": 4, "ar": 0})
    turns = list(e2e.give_turns(tmp_path, procs, ["bole", "mtp3", "ar"], [1, 4, 8]))
    for proc in procs.values():
        proc.wait(timeout=30)
    assert [(name, b) for name, b, _ in turns] == [("bole", 1), ("mtp3", 1), ("ar", 1), ("bole", 4), ("ar", 4),
                                                  ("bole", 8), ("ar", 8)]
    assert (tmp_path / "turns.log").read_text().split("\n")[:-1] == [
        "bole 1 start", "bole 1 end", "mtp3 1 start", "mtp3 1 end", "ar 1 start", "ar 1 end",
        "bole 4 start", "bole 4 end", "mtp3 4 start", "ar 4 start", "ar 4 end",
        "bole 8 start", "bole 8 end", "ar 8 start", "ar 8 end"]
    assert procs["mtp3"].returncode == 3 and procs["bole"].returncode == 0


def test_rounds_take_turns_round_by_round(tmp_path):
    """--rounds 2: at each batch size every configuration times its first round, then every configuration its
    second, so that a slow spell of the machine falls on all of them."""
    e2e = _e2e()
    procs = _fake_workers(e2e, tmp_path, [1, 4], "time.sleep(0.02)", {"bole": 0, "mtp3": 0}, rounds=2)
    turns = list(e2e.give_turns(tmp_path, procs, ["bole", "mtp3"], [1, 4], rounds=2))
    for proc in procs.values():
        proc.wait(timeout=30)
    assert [(name, b) for name, b, _ in turns] == [("bole", 1), ("mtp3", 1)] * 2 + [("bole", 4), ("mtp3", 4)] * 2
    starts = [line for line in (tmp_path / "turns.log").read_text().split("\n") if line.endswith("start")]
    assert starts == ["bole 1 start", "mtp3 1 start", "bole 1.1 start", "mtp3 1.1 start",
                      "bole 4 start", "mtp3 4 start", "bole 4.1 start", "mtp3 4.1 start"]
    assert all(proc.returncode == 0 for proc in procs.values())
    with pytest.raises(SystemExit):
        e2e.build_parser().parse_args(["--rounds", "0"])


def test_turns_per_gpu_run_side_by_side_and_wait_for_the_calibration(tmp_path):
    """--gpus 2: each GPU's configurations take their turns at the same time as the other GPU's; a Bole
    configuration waits for the calibrating one's first turn even on the other GPU."""
    e2e = _e2e()
    seconds = {"bole_sync": 1.0, "ar": 0.02, "mtp3": 0.02, "bole": 0.02}
    procs = _fake_workers(e2e, tmp_path, [1, 4], "time.sleep(arg if b == 1 else 0.02)", seconds)
    groups = e2e.gpu_groups(["bole_sync", "mtp3", "ar", "bole"], 2)
    assert groups == [["bole_sync", "ar"], ["mtp3", "bole"]]
    turns = e2e.give_turns_per_gpu(tmp_path, procs, groups, [1, 4], calibrating="bole_sync")
    for proc in procs.values():
        proc.wait(timeout=30)
    assert sorted((n, b) for n, b, _ in turns) == sorted((n, b) for n in seconds for b in (1, 4))
    lines = (tmp_path / "turns.log").read_text().split("\n")[:-1]
    at = {line: i for i, line in enumerate(lines)}
    assert at["mtp3 1 end"] < at["bole_sync 1 end"]          # the other GPU did not wait for the calibration ...
    assert at["bole 1 start"] > at["bole_sync 1 end"]        # ... but its Bole configuration did
    for group in groups:                                      # one turn at a time on each GPU
        mine = [line for line in lines if line.split()[0] in group]
        assert all(a.rsplit(" ", 1)[0] == b.rsplit(" ", 1)[0] for a, b in zip(mine[::2], mine[1::2])), mine


def test_engines_that_do_not_fit_one_gpu_stop_before_starting(tmp_path, monkeypatch):
    """More engines per GPU than ``--gpu-share`` leaves room for: a one-line error naming the option, before any
    engine starts; spread over two GPUs the same configurations pass that check."""
    import pytest

    e2e = _e2e()
    argv = ["--configs", "mtp3,bole_vocab32k,bole_decode_vocab32k,bole_sync", "--gpu-share", "0.3",
            "--model", str(tmp_path), "--out", str(tmp_path / "e2e.json")]
    with pytest.raises(SystemExit, match=r"--gpu-share: 4 engines x 0.3"):
        e2e.main(argv)
    assert not (tmp_path / "e2e.json").exists()
    started = []
    monkeypatch.setattr(e2e, "run_configs", lambda args, forwarded, out: started.append(args.configs) or {})
    e2e.main(argv + ["--gpus", "2"])
    assert started == [["mtp3", "bole_vocab32k", "bole_decode_vocab32k", "bole_sync"]]


def test_settling_needs_clean_passes_in_a_row():
    """The warm-up goes on until ``clean_needed`` passes in a row captured nothing; a pass that captures starts
    the count again; ``max_passes`` bounds it."""
    e2e = _e2e()

    def run(captures, max_passes, clean_needed):
        held, script = [0], iter(captures)

        def generate():
            held[0] += next(script)
        return e2e.settle_graphs(generate, lambda: held[0], max_passes, clean_needed)

    assert run([1, 0, 2, 0, 0, 5], 8, 2) == 5     # clean after the 2nd pass, then a capture: two more clean ones
    assert run([0, 0], 8, 2) == 2
    assert run([1, 1, 1, 1], 3, 2) == 3          # never settles: stops at the bound
    assert run([3, 0], 8, 1) == 2                # one clean pass, as before
    assert run([], 0, 2) == 0


def test_plot_series_by_batch_size_and_over_the_best_async_chain(tmp_path):
    """What <out>.png draws: every configuration's tok/s in batch order, and each Bole configuration over the best
    asynchronous MTP chain of its batch size (a synchronous chain is not the reference; a size no chain ran has no
    ratio). --plot-only draws it from the results file alone, or says that matplotlib is missing."""
    import json

    e2e = _e2e()
    batches = lambda **v: {"gpu": "G", "concurrency": 10.0,   # noqa: E731
                           "batches": {b: {"tok_s": t} for b, t in v.items()}}
    data = {"configs": {"mtp3": batches(**{"8": 300.0, "1": 100.0}), "mtp4": batches(**{"1": 120.0, "8": 250.0}),
                        "mtp4_sync": batches(**{"1": 900.0}), "ar": batches(**{"1": 50.0, "8": 0.0}),
                        "bole": batches(**{"1": 180.0, "8": 390.0, "64": 1000.0})}}
    series = e2e.plot_series(data)
    assert series["tok_s"]["mtp3"] == [(1, 100.0), (8, 300.0)] and series["tok_s"]["ar"] == [(1, 50.0)]
    assert series["speedup_vs_best_mtp"] == {"bole": [(1, 1.5), (8, 1.3)]}
    out = tmp_path / "e2e.json"
    out.write_text(json.dumps(data))
    assert e2e.main(["--plot-only", "--out", str(out)]) == 0
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not (tmp_path / "e2e.png").exists()
    else:
        assert (tmp_path / "e2e.png").stat().st_size > 0


def test_engine_steps_split_a_run_into_prefill_full_batch_steps_and_tail():
    steps = load_benchmark("engine_steps")
    # Two requests: two prefill steps (no token yet, then both hold one), three steps with both decoding (5, 3
    # and 4 tokens), then one finishes and the other drains in two steps.
    run = steps.RunSteps(start=10.0, end=10.100)
    run.log = [(10.010, 2, 0, 0), (10.020, 2, 2, 2), (10.030, 2, 2, 7), (10.042, 2, 2, 10), (10.052, 2, 2, 14),
               (10.060, 1, 1, 6), (10.090, 1, 1, 9)]
    s = steps.summarize(run, 2)
    assert s["steps"] == 7 and s["full_steps"] == 3 and s["tail_steps"] == 2
    assert s["prefill_ms"] == pytest.approx(20.0)
    assert s["full_step_ms"] == pytest.approx(10.0)   # the median of 10, 12 and 10 ms
    assert s["full_tok_s"] == pytest.approx(12 / 0.032)
    assert s["tail_ms"] == pytest.approx(48.0) and s["prefill_steps"] == 2
    assert s["tail_step_ms"] == pytest.approx(19.0)   # the median of 8 and 30 ms
    assert steps.summarize(steps.RunSteps(start=0.0, end=1.0, log=[(0.5, 1, 1, 1)]), 2) is None   # never whole
    combined = steps.combine([s, None, dict(s, full_step_ms=14.0, tail_ms=None)])
    assert steps.summarize(steps.RunSteps(start=0.0, end=0.3, log=[(0.1, 1, 1, 1), (0.2, 0, 0, 0)]), 1)[
        "tail_step_ms"] == pytest.approx(100.0)
    assert combined["full_step_ms"] == 12.0 and combined["tail_ms"] == 48.0 and combined["steps"] == 7
    assert steps.combine([None]) is None


def test_engine_steps_log_each_step_of_a_call_only():
    steps = load_benchmark("engine_steps")

    class Req:
        def __init__(self, n):
            self.num_output_tokens = n

    scheduler = type("S", (), {"running": [Req(0), Req(3)]})()
    engine = type("E", (), {})()
    engine.engine_core = type("C", (), {"engine_core": type("EC", (), {"scheduler": scheduler})()})()
    engine.step = lambda: ["out"]
    llm = type("L", (), {"llm_engine": engine})()
    logger = steps.EngineSteps(llm)
    assert engine.step() == ["out"]   # outside a run: passed through, not logged
    with logger.run() as run:
        assert engine.step() == ["out"]
        scheduler.running = [Req(4)]
        engine.step()
    assert [entry[1:] for entry in run.log] == [(2, 1, 3), (1, 1, 4)] and run.end >= run.log[-1][0] >= run.start


def test_steps_table_and_bole_concurrency_of_a_variant():
    e2e = _e2e()
    phases = {"steps": 60, "prefill_ms": 80.0, "prefill_steps": 4, "full_steps": 39, "full_step_ms": 25.1,
              "full_tok_s": 13400.0, "tail_steps": 20, "tail_ms": 400.0, "tail_step_ms": 20.0}
    configs = {"mtp3": _config(300.0, 53.5, engine_steps=phases),
               "mtp3_sync": _config(300.0, 53.5, engine_steps=dict(phases, full_tok_s=26800.0)),
               "bole_vocab32k": _config(330.0, 126.0, mean_accepted=5.3,
                                        engine_steps=dict(phases, full_tok_s=20100.0))}
    [row] = e2e.build_rows(configs)
    assert row["concurrency_bole"] == 126.0   # no "bole" config: its variant's KV cache is the same
    table = e2e.steps_markdown(configs).splitlines()
    assert table[2] == "| mtp3 | 4 | 60 | 80.0 | 39 | 25.10 | 13400 | 1.00× | 20 | 400.0 | 20.00 |"
    assert table[3].startswith("| mtp3_sync | 4 |") and "| 26800 | 2.00× |" in table[3]   # not the best chain
    assert table[4].startswith("| bole_vocab32k | 4 |") and "| 20100 | 1.50× |" in table[4]
    assert e2e.steps_markdown({"ar": _config(100.0)}) == ""


def test_drain_counts_the_steps_until_the_first_and_the_last_request_finish():
    drain = load_benchmark("drain")
    from vllm_bole.spec_decode.synthetic import SyntheticAcceptance

    always = SyntheticAcceptance(rates=(1.0, 1.0, 1.0), sibling_rates=())
    assert drain.drain(4, 17, 3, always) == (4, 4)     # 16 tokens after the prefill's, 4 per step
    assert drain.drain(2, 10, 0, always) == (9, 9)     # no drafts: one token per step
    first, last = drain.drain(64, 256, 8, SyntheticAcceptance(seed=1))
    assert 20 < first < last < 256
