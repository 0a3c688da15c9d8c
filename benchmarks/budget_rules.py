"""The budget rules in a closed loop over a calibration table's measured forwards (no GPU, no engine).

    python3 benchmarks/budget_rules.py [--table benchmarks/results/budget_table.json] [--gpu H100] [--lag 1]

Each batch size of the table's entries for ``--gpu`` (its ``--kv-len`` bucket) runs ``--steps`` steps of the
throughput rule's own loop (``BudgetPolicy._throughput``: the step clock ticks, probes, the kept choice) against
a step that costs the table's T_ver(N) (linear between its points, as the rule reads it) plus a rest that grows
with the nodes per request, ``base + slope * N / B`` (``--rest``), with ``--noise`` relative noise; the host
records each period with the size of the step ``--lag`` steps later (async scheduling). Acceptance: the
expected tokens of the best-first trees at the synthetic default rates (``--rates``, unconditional per depth as
``synthetic_acceptance`` reads them, ``--sibling-rates``), each node matched only inside a draft vocabulary of
``--draft-vocab-coverage`` (the default's ``draft_vocab: "auto"``, priced as benchmarks/e2e.py prices it).
Three rules side by side:

* ``table``: the throughput rule with the table's curves (from B_ver up), the default where a table applies;
* ``measured``: ``budget_table: "measured"`` (no table: whole steps measured, candidates 1-32 nodes a request);
* ``fixed``: what a Bole engine without a table runs by default (``budget_table.default_budget``: 8 nodes a
  request up to 384 a step, at least 128 a step and 3 a request).

Each gets the tokens per ms of its last ``--last`` steps (probes included) as a share of the best candidate's
(the best of every size either rule could choose), and the sizes it settled on. The default rests are the H100's
(docs/results.md, "The default without a calibration table (H100)"): a full-batch step minus the table's T_ver of
its size, 3.6 ms at batch 1 (32 nodes a request), 4.4 ms at batch 16 (8) and 8.6 and 8.1 ms at batch 64 (3, and
the measured rule's 5.6 on average): flat in the nodes a request there; batch 32 in between.
"""

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_bole.spec_decode.acceptance_model import best_first_curve  # noqa: E402
from vllm_bole.spec_decode.budget_table import MeasuredBudgets, ModelBudgets, default_budget, read_table  # noqa: E402
from vllm_bole.spec_decode.synthetic import DEFAULT_RATES, DEFAULT_SIBLING_RATES, SyntheticAcceptance  # noqa: E402
from vllm_bole.testing.budget_loop import closed_loop  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEPTH, TOPK = 8, 4   # Bole's default trees: 32 nodes a request at most
# batch size -> (base ms, ms per node per request) of a step besides its target forward, on the H100 (above)
DEFAULT_REST = {1: (3.6, 0.0), 16: (4.4, 0.0), 32: (6.4, 0.0), 64: (8.3, 0.0)}
DEFAULT_COVERAGE = 0.945   # benchmarks/e2e.py's --draft-vocab-coverage


def parse_rest(text: str) -> dict[int, tuple[float, float]]:
    """``B:base:slope,...``."""
    out = {}
    for part in filter(None, text.split(",")):
        b, base, slope = part.split(":")
        out[int(b)] = (float(base), float(slope))
    return out


def acceptance_curve(rates, sibling_rates, coverage: float = 1.0) -> list[float]:
    """Expected tokens of a request's step with its q best nodes, q = 0 .. TOPK * DEPTH, under synthetic acceptance
    at these (unconditional) ``rates`` and ``sibling_rates`` with a draft vocabulary of ``coverage``."""
    synthetic = SyntheticAcceptance(tuple(rates), tuple(sibling_rates))
    first = [synthetic.in_vocab_rank1_rate(d) for d in range(1, DEPTH + 1)]
    curve = best_first_curve(first, list(sibling_rates), TOPK, DEPTH, cap=TOPK * DEPTH, coverage=coverage)
    return curve + [curve[-1]] * (TOPK * DEPTH + 1 - len(curve))


def compare(entries: list[dict], kv_len: int, rest: dict, steps: int, last: int, noise: float, lag: int,
            rates, sibling_rates, coverage: float = 1.0, seed: int = 0) -> list[dict]:
    """One row per batch size of ``entries`` (one GPU and model): each rule's share of the best rate, for Bole's
    default trees (``DEPTH`` levels of ``TOPK`` children; past the rates the last conditional rate repeats, as
    the synthetic draws do)."""
    per_request = TOPK * DEPTH
    curve = acceptance_curve(rates, sibling_rates, coverage)
    table = ModelBudgets.from_entries(entries)
    rows = []
    for batch in table.batch_sizes:
        base, slope = rest[min(rest, key=lambda b: (abs(b - batch), b))]

        def tokens(n, batch=batch):
            return batch * curve[min(n // batch, per_request)]

        def step_ms(n, batch=batch, base=base, slope=slope):
            return table.t_ver_ms(batch, kv_len, n) + base + slope * n / batch

        def rate(sizes):
            return sum(map(tokens, sizes)) / sum(map(step_ms, sizes))

        measured = MeasuredBudgets.for_requests(per_request)
        sizes = {p["nodes"] for budgets in (table, measured)
                 for p in budgets.throughput_estimates(batch, kv_len, 1.0, tokens)}
        best = max(sorted(sizes), key=lambda n: tokens(n) / step_ms(n))
        top = tokens(best) / step_ms(best)
        row = {"batch_size": batch, "rest_ms": [base, slope], "best_nodes": best, "best_tokens_per_ms": round(top, 4)}
        fixed = min(default_budget(batch), batch * per_request)
        for name, budgets in (("table", table), ("measured", measured)):
            chosen = closed_loop(budgets, batch, kv_len, step_ms, tokens, steps, lag=lag, noise=noise,
                                 seed=seed)[-last:]
            row[name] = {"share": round(rate(chosen) / top, 4),
                         "settled": [n for n, _ in collections.Counter(chosen).most_common(2)],
                         "largest": max(chosen)}
        row["fixed"] = {"share": round(rate([fixed]) / top, 4), "settled": [fixed]}
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| batch | best (nodes, tokens/ms) | throughput rule, table | measured, no table | fixed, no table |",
             "|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r[k]['share']:.3f} ({', '.join(map(str, r[k]['settled']))})" for k in ("table", "measured",
                                                                                             "fixed")]
        lines.append(f"| {r['batch_size']} | {r['best_nodes']}, {r['best_tokens_per_ms']:.3f} | " + " | ".join(cells)
                     + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--table", default=str(ROOT / "benchmarks/results/budget_table.json"))
    p.add_argument("--gpu", default="H100", help="entries whose GPU name holds this")
    p.add_argument("--kv-len", type=int, default=1024)
    p.add_argument("--rest", default="", help="B:base_ms:ms_per_node_per_request,... (default: the H100's)")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--last", type=int, default=500, help="steps whose rate counts")
    p.add_argument("--noise", type=float, default=0.03)
    p.add_argument("--lag", type=int, default=1, help="steps between a choice and the period measured with it")
    p.add_argument("--rates", default=",".join(map(str, DEFAULT_RATES)))
    p.add_argument("--sibling-rates", default=",".join(map(str, DEFAULT_SIBLING_RATES)))
    p.add_argument("--draft-vocab-coverage", type=float, default=DEFAULT_COVERAGE,
                   help="the draft vocabulary's share of the target's tokens (1: the full vocabulary)")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/budget_rules.json"))
    args = p.parse_args(argv)
    entries = [e for e in read_table(Path(args.table)) if args.gpu in e["gpu"] and e.get("points")]
    models = {e["fingerprint"] for e in entries}
    if len(models) != 1:
        raise SystemExit(f"--gpu {args.gpu!r}: {len(models)} models calibrated in {args.table}; need one")
    kv_lens = sorted({e["kv_len"] for e in entries}, key=lambda kv: abs(kv - args.kv_len))
    entries = [e for e in entries if e["kv_len"] == kv_lens[0]]
    rows = compare(entries, kv_lens[0], parse_rest(args.rest) or DEFAULT_REST, args.steps, args.last, args.noise,
                   args.lag, [float(v) for v in args.rates.split(",")],
                   [float(v) for v in args.sibling_rates.split(",")], args.draft_vocab_coverage)
    out = {"command": "python3 benchmarks/budget_rules.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "gpu": entries[0]["gpu"], "model": entries[0]["fingerprint"], "kv_len": kv_lens[0], "steps": args.steps,
           "last": args.last, "noise": args.noise, "lag": args.lag, "draft_vocab_coverage": args.draft_vocab_coverage,
           "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(markdown(rows))
    return out


if __name__ == "__main__":
    main()
