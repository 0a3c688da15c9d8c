"""End-to-end decoding throughput at Qwen3.5-9B shapes: stock vLLM AR, stock vLLM MTP chains, Bole (budget "auto").

    python3 benchmarks/e2e.py --configs ar,mtp1,mtp2 --kv-cache-gib 18            # three engines, one command
    python3 benchmarks/e2e.py --configs bole_sync,mtp3,bole --calibrate --kv-cache-gib 16
    python3 benchmarks/e2e.py --smoke                                              # CPU, the tiny bundled model

Configurations (``--configs``; ``benchmarks/serve.py`` takes the same names): ``ar`` (no speculation);
``mtp1`` .. ``mtp8`` (vLLM's MTP chain of k drafts with ``rejection_sample_method: "synthetic"``) and ``mtp1_sync``
.. ``mtp8_sync`` (the chain with ``async_scheduling: false``: rows gain ``mtp_sync_tok_s_by_k``; not counted as the
best chain); ``bole`` (tree speculation with ``synthetic_acceptance`` and ``budget: "auto"``, otherwise Bole's
defaults, among them ``selection: "per_request"``, ``draft_vocab: "auto"`` (its synthetic acceptance pays for the
subset, below) and the engine's default scheduling: asynchronous on a GPU; the ``bole`` rows of result files from
before that default drafted from the full vocabulary); Bole's named variants
(``BOLE_VARIANTS``, keys over ``bole``'s speculative config): ``bole_global`` (``selection: "global"``: the best
nodes over the whole batch, the scheduler waits for the drafts), ``bole_step`` (``budget_rule: "step"``: the budget
also weighs the step's measured time besides its target forward), ``bole_vocab32k`` (``draft_vocab: 32768``: the
drafter's LM head over the 32768 lowest token ids; its synthetic acceptance stops the walk wherever the target's
token is outside them, with probability 1 − ``--draft-vocab-coverage`` per depth; result files from before that
option accepted by rank alone, at no cost for the subset), ``bole_decode_vocab32k`` (also ``budget_rule:
"decode"``: the calibrated B_ver every step, the default before "throughput"), ``bole_late``
(``early_drafting: false``: the drafter catches up after the host walk instead of being queued before it),
``bole_full_vocab`` (``draft_vocab: null``: the drafter's full LM head), ``bole_vllm_kv_groups``
(``kv_cache_groups: "vllm"``: vLLM's own KV-cache groups), ``bole_cold`` (``warmup: false``: no start-up
warm-up), ``bole_sync`` and ``bole_vocab32k_sync``
(``async_scheduling: false``), ``bole_measured`` (``budget_table: "measured"``: no calibration table, the throughput
rule measures whole steps); and ``--variant NAME=JSON`` (repeatable: keys over ``bole``'s speculative config,
``null`` as the config reads it, e.g. ``"budget_table": null`` no table,
``async_scheduling`` is the engine's setting), e.g. ``--variant bole_tput='{"budget_rule": "throughput"}'``. Each
Bole configuration besides ``bole`` adds ``<name>_*`` fields to the rows and a table of its own; result files
may also hold configurations no longer offered (``bole_global_step``, ``bole_tput_vocab32k``, ...), reported
like the others. ``--calibrate`` first runs the budget calibration in the first Bole configuration that
schedules synchronously (``*_sync``, ``bole_global``, ``bole_step``; it is timed first) and merges it into
``--budget-table``, which the invocation's other Bole configurations then read.

Each configuration runs in its own process that starts its engine once and then runs every batch size; whatever
order ``--configs`` names them in, they take the order ar, the chains by k, bole, the named variants, the
``--variant`` ones, the synchronous chains. All engines of one invocation start at the same time on the one GPU
(each with a fixed KV cache, ``--kv-cache-gib``, so concurrent start-ups cannot skew each other's memory profile);
the timed phases then run strictly one engine at a time (the others sit idle, waiting for their turn), batch size
by batch size: every configuration times batch 1, then every configuration batch 4, and so on, so that drift over
the run (clocks, heat, a neighbour on the machine) falls on the configurations of a batch size alike. ``--gpus N``
spreads them over N GPUs of the machine (configuration i on GPU i mod N), each GPU giving its own turns at the
same time as the others (the grid of AR, MTP k=1..4 and Bole does not fit one GPU's memory at once). Results are
merged by configuration into ``--out``, so several invocations fill one table.

Per batch size B: B token-id prompts of ``--prompt-len`` tokens, a warm-up ``generate`` of ``--warmup-tokens``
tokens (default: as long as the timed one, so every step shape has run once; ``--warmup-passes`` of them, and for
Bole up to ``--settle-passes`` more until ``--settle-clean`` passes in a row captured no CUDA graph: Bole captures a
graph on the first use of a step shape, which a serving engine soon stops meeting, and a drained batch's shapes
differ from pass to pass), then a timed ``generate`` of
``--new-tokens`` tokens (ignore_eos), repeated until ``--min-timed-s`` of wall time and at least
``--min-timed-runs`` times (at most ``--max-timed-runs``): tok/s = the median over those runs of generated tokens /
wall time (``--rounds R`` splits those runs into R rounds, every configuration's round r before any
configuration's round r + 1, so that a slow spell of the machine falls on all configurations of the batch size;
rows then also hold each round's median, ``tok_s_rounds``); mean accepted tokens per step = 1 + accepted / drafts from vLLM's spec-decode counters over the timed
run (tokens per request per verification step, bonus token included). Concurrency: vLLM's "maximum concurrency for
max_model_len tokens per request" of the engine's KV cache config (``get_kv_cache_capacity``, with
``--max-model-len``, default 2048), at the KV cache size recorded in the JSON.

Each batch entry's ``engine_steps`` splits the timed runs into their phases (``benchmarks/engine_steps.py``,
medians over the runs): the prefill, the steps with all B requests decoding (their median period and tok/s: what a
server holding B requests in flight sees) and the draining tail after the first request finished; a table of
them is printed after the results.

Acceptance source, the same for both methods: ``--rates`` are per-position *unconditional* acceptance rates of
the rank-1 chain, the convention of vLLM's ``synthetic_acceptance_rates`` and of Bole's ``synthetic_acceptance``
(so a one-wide Bole tree accepts exactly like the MTP chain): MTP k gets the first k, Bole all of them (past the
list its last conditional rate repeats) plus ``--sibling-rates`` for rank-2.. children. ``--acceptance-profile FILE``
takes both lists from an acceptance profile measured on a real model (``vllm-bole acceptance-profile``).

Output rows (``rows`` in the JSON, one per B): B, ar_tok_s, mtp_best_k, mtp_best_tok_s, bole_tok_s,
bole_mean_accepted, speedup_vs_mtp, speedup_vs_ar, concurrency_ar, concurrency_mtp (of the best k),
concurrency_bole, gpu, plus per-k MTP numbers; ``configs`` holds each configuration's raw results and settings
(a Bole configuration's batches also: graphs captured in the timed runs, by count and by key), ``calibration``
the T_ver(N)/T_dec curves. A markdown table is printed at the end.
"""

import argparse
import collections
import contextlib
import itertools
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllm_bole._vllm_compat import engine_core_of, model_runner_of  # noqa: E402
from vllm_bole.config import draft_vocab_of  # noqa: E402
from vllm_bole.errors import BoleConfigError  # noqa: E402
from vllm_bole.spec_decode.synthetic import DEFAULT_RATES, DEFAULT_SIBLING_RATES, profile_rates  # noqa: E402

# Bole's named variants: the keys each one sets over ``bole``'s speculative config, as ``--variant`` takes them
# ("async_scheduling" is the engine's setting; the others keep the engine's default scheduling: asynchronous on a
# GPU, except where selection "global" or budget_rule "step" need synchronous steps).
BOLE_VARIANTS = {"bole_global": {"selection": "global"}, "bole_step": {"budget_rule": "step"},
                 # The drafter proposes from 32768 token ids only; synthetic acceptance pays for the target's
                 # tokens outside them (--draft-vocab-coverage).
                 "bole_vocab32k": {"draft_vocab": 32768},
                 # The full vocabulary (the default draft_vocab "auto" is an eighth of it, learned from the
                 # tokens the target emits).
                 "bole_full_vocab": {"draft_vocab": None},
                 "bole_decode_vocab32k": {"budget_rule": "decode", "draft_vocab": 32768},
                 # Drafting after the host walk (before it is the default: speculative_config.early_drafting).
                 "bole_late": {"early_drafting": False},
                 # vLLM's own KV-cache groups (4 at the 9B shape, against the 11 that hold a request in the
                 # fewest bytes).
                 "bole_vllm_kv_groups": {"kv_cache_groups": "vllm"},
                 # No start-up warm-up: graphs captured and kernels compiled on first use, while serving.
                 "bole_cold": {"warmup": False},
                 "bole_sync": {"async_scheduling": False},
                 "bole_vocab32k_sync": {"draft_vocab": 32768, "async_scheduling": False},
                 # The throughput rule without a calibration table: it measures whole steps itself.
                 "bole_measured": {"budget_table": "measured"}}
# Keys of a variant that are engine settings, not speculative config keys.
ENGINE_KEYS = ("async_scheduling",)
# A variant's key for its synthetic_acceptance's draft_vocab_coverage (apply_overrides).
COVERAGE_KEY = "draft_vocab_coverage"
# --draft-vocab-coverage's default: the coverage of the 512 tokens most frequent in the training text on the trained
# small Qwen3.5's held-out output (docs/results.md, "Draft vocabulary on the trained model"): 12.5% of its
# vocabulary, the share draft_vocab 32768 is of Qwen3.5's.
DEFAULT_DRAFT_VOCAB_COVERAGE = 0.945
MAX_CHAIN = 8   # mtp1 .. mtp8
DEFAULT_CONFIGS = "ar,mtp1,mtp2,mtp3,mtp4,bole"
# Token counts vLLM pads a step to, and so the token sizes of Bole's verification and drafter graphs. Tree steps
# carry B + (up to the budget) tokens: sizes over that whole range, vLLM's spacing (8, then 32).
BOLE_GRAPH_SIZES = {1, 2, 4, *range(8, 256, 8), *range(256, 1025, 32)}
# The repository's copy travels to a GPU machine with the working tree; the shared one is its source.
MODEL_CANDIDATES = (ROOT / "benchmarks/models/qwen3.5-9b-shape", ROOT.parent / "shared/models/qwen3.5-9b-shape")
POLL_S = 0.5
DEFAULT_BUDGET_TABLE = str(ROOT / "benchmarks/results/budget_table.json")
NO_BUDGET_TABLE = "no-budget-table.json"   # --budget-table '': a path in the log directory that holds no table


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def _ints(text: str) -> list[int]:
    return sorted({int(v) for v in text.split(",") if v.strip()})


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


# ---- configurations: names and settings (benchmarks/serve.py takes the same) ---------------------------------
def chain_k(name: str) -> int | None:
    """k of an MTP chain configuration (``mtp<k>``, ``mtp<k>_sync``), None for any other name."""
    m = re.fullmatch(rf"mtp([1-{MAX_CHAIN}])(_sync)?", name)
    return int(m[1]) if m else None


def is_chain(name: str) -> bool:
    """An MTP chain with the engine's default scheduling: the chains the best one is picked from."""
    return chain_k(name) is not None and not name.endswith("_sync")


def split_configs(text: str) -> list[str]:
    """``--configs`` split on commas outside braces, so ``bole:{"a": 1, "b": 2}`` stays one item."""
    items, depth, cur = [], 0, []
    for ch in text:
        depth += (ch in "{[") - (ch in "}]")
        if ch == "," and depth == 0:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    items.append("".join(cur))
    return [i.strip() for i in items if i.strip()]


def parse_variant(text: str) -> tuple[str, dict]:
    """``--variant NAME=JSON``: a Bole configuration named NAME, the JSON object's keys over ``bole``'s
    speculative config (``null`` removes a key; ``async_scheduling`` is the engine's setting)."""
    name, sep, spec = text.partition("=")
    name = name.strip()
    try:
        value = json.loads(spec) if sep else None
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: {e}") from None
    if not name or not isinstance(value, dict) or not re.fullmatch(r"[A-Za-z0-9_.+-]+", name):
        raise argparse.ArgumentTypeError(f"--variant: expected NAME=JSON-object, got {text!r}")
    if name == "ar" or chain_k(name) is not None:
        raise argparse.ArgumentTypeError(f"--variant {name}: the name of a configuration without Bole")
    return name, value


def allowed_configs(variants: dict[str, dict] | None = None, inline: bool = False) -> list[str]:
    """The configuration names, in the order e2e.py runs them; ranges and the inline form as one item each."""
    variants = variants or {}
    names = ["ar", f"mtp1..mtp{MAX_CHAIN}", "bole", *BOLE_VARIANTS, *(v for v in variants if v not in BOLE_VARIANTS),
             f"mtp1_sync..mtp{MAX_CHAIN}_sync"]
    return names + ["bole:{JSON}"] * inline


def config_names(text: str, variants: dict[str, dict] | None = None, inline: bool = False) -> list[str]:
    """The configurations of ``--configs`` as given, each once; ``inline``: also ``bole:{JSON}`` (serve.py). An
    unknown name exits with one line that names the allowed ones."""
    names, variants = split_configs(text), variants or {}
    known = {"ar", "bole", *BOLE_VARIANTS, *variants}
    bad = [n for n in names if n not in known and chain_k(n) is None and not (inline and n.startswith("bole:"))]
    if bad or not names:
        raise SystemExit(f"--configs: {'unknown ' + ', '.join(bad) if bad else 'none given'}; allowed: "
                         f"{', '.join(allowed_configs(variants, inline))} (and names given by --variant NAME=JSON)")
    return list(dict.fromkeys(names))


def run_order(names: list[str], variants: dict[str, dict] | None = None) -> list[str]:
    """``names`` in the order e2e.py starts and times them: ar, the chains by k, bole, the named variants, the
    ``--variant`` ones, the synchronous chains."""
    variants = variants or {}
    named = ["ar", *(f"mtp{k}" for k in range(1, MAX_CHAIN + 1)), "bole", *BOLE_VARIANTS,
             *(v for v in variants if v not in BOLE_VARIANTS), *(f"mtp{k}_sync" for k in range(1, MAX_CHAIN + 1))]
    return sorted(names, key=lambda n: named.index(n) if n in named else len(named))


def bole_overrides(name: str, variants: dict[str, dict] | None = None) -> dict | None:
    """The keys a Bole configuration sets over ``bole``'s speculative config (``async_scheduling``: the engine's
    setting; a None value removes the key), None for a configuration without Bole. ``--variant`` names first, then
    the inline ``bole:{JSON}``, then the named variants."""
    if name in (variants or {}):
        return dict(variants[name])
    if name.startswith("bole:"):
        try:
            value = json.loads(name[len("bole:"):])
        except json.JSONDecodeError as e:
            raise SystemExit(f"--configs {name!r}: {e}") from None
        if not isinstance(value, dict):
            raise SystemExit(f"--configs {name!r}: expected a JSON object")
        return value
    if name == "bole":
        return {}
    return dict(BOLE_VARIANTS[name]) if name in BOLE_VARIANTS else None


def is_bole(name: str, variants: dict[str, dict] | None = None) -> bool:
    return bole_overrides(name, variants) is not None


def apply_overrides(spec: dict, overrides: dict, coverage: float | None = None) -> tuple[dict, dict]:
    """(speculative config, engine settings) of ``overrides`` over the speculative config ``spec``. Where the
    result drafts from a ``draft_vocab`` under synthetic acceptance, that acceptance pays for the subset:
    ``draft_vocab_coverage`` (a variant's own key, else ``coverage``: ``--draft-vocab-coverage``) goes into its
    ``synthetic_acceptance``."""
    spec, engine = dict(spec), {}
    for key, value in overrides.items():
        if key in ENGINE_KEYS:
            engine[key] = value
        elif key == COVERAGE_KEY:
            coverage = value
        else:
            spec[key] = value
    if draft_vocab_of(spec) is not None and isinstance(spec.get("synthetic_acceptance"), dict) \
            and coverage is not None:
        spec["synthetic_acceptance"] = {**spec["synthetic_acceptance"], COVERAGE_KEY: coverage}
    return spec, engine


def _budget_overrides(text: str) -> dict[int, int]:
    try:
        pairs = [item.split("=") for item in text.split(",") if item.strip()]
        return {int(b): int(n) for b, n in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected batch=nodes pairs such as 16=96,32=192, got {text!r}") from None


def override_budgets(table: Path, budgets: dict[int, int], out_dir: Path) -> Path:
    """A copy of the calibration table whose entries at the given batch sizes have those budgets (``b_ver``, every
    KV bucket); the curves stay as measured. Returns its path."""
    if not table.exists():
        raise SystemExit(f"--budgets: no calibration table at {table} (calibrate first, or pass --budget-table)")
    data = json.loads(table.read_text())
    missing = set(budgets) - {int(e["batch_size"]) for e in data["entries"]}
    if missing:
        raise SystemExit(f"--budgets: {table} has no entry at batch sizes {sorted(missing)}")
    for entry in data["entries"]:
        if int(entry["batch_size"]) in budgets:
            entry["b_ver"] = budgets[int(entry["batch_size"])]
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "budget_table-override.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help=f"comma-separated: {', '.join(allowed_configs())}, --variant names (default: %(default)s)")
    p.add_argument("--variant", type=parse_variant, action="append", default=[], metavar="NAME=JSON",
                   help="a Bole configuration: these keys over bole's speculative config (null removes one; "
                        "async_scheduling is the engine's setting); repeatable")
    p.add_argument("--model", default=None, help="default: benchmarks/models/qwen3.5-9b-shape (dummy weights)")
    p.add_argument("--batch-sizes", type=_ints, default=[1, 4, 8, 16, 32, 64])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--warmup-tokens", type=int, default=None, help="warm-up generate length (default: --new-tokens)")
    p.add_argument("--warmup-passes", type=int, default=2,
                   help="warm-up generates per batch size before its timed one (Bole's lazy graph captures: the "
                        "timed rows still report the captures they ran)")
    p.add_argument("--settle-passes", type=int, default=8,
                   help="Bole: after the warm-up passes, up to this many more until --settle-clean passes in a row "
                        "captured no graph")
    p.add_argument("--settle-clean", type=int, default=2,
                   help="Bole: passes in a row without a new graph that end the settling")
    p.add_argument("--min-timed-s", type=float, default=3.0,
                   help="repeat a batch size's timed run until this much wall time (tok/s: the runs' median)")
    p.add_argument("--min-timed-runs", type=int, default=3, help="timed runs per batch size, at least")
    p.add_argument("--max-timed-runs", type=int, default=5)
    p.add_argument("--rounds", type=_positive, default=1,
                   help="time each batch size in this many rounds, every configuration's round r before any "
                        "configuration's round r + 1, so that a slow spell of the machine falls on all of them; "
                        "the --min-timed-* and --max-timed-runs amounts are split over the rounds (tok/s: the "
                        "median over every round's runs)")
    p.add_argument("--max-model-len", type=int, default=2048, help="also the request length of the concurrency")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=float, default=18.0, help="fixed KV cache per engine")
    p.add_argument("--gpu-share", type=float, default=0.28, help="gpu_memory_utilization per engine")
    p.add_argument("--rates", type=_floats, default=list(DEFAULT_RATES), help="unconditional, per position")
    p.add_argument("--sibling-rates", type=_floats, default=list(DEFAULT_SIBLING_RATES))
    p.add_argument("--draft-vocab-coverage", type=float, default=DEFAULT_DRAFT_VOCAB_COVERAGE,
                   help="Bole configurations with a draft_vocab: the share of the target's tokens inside it "
                        "(synthetic_acceptance.draft_vocab_coverage; a variant's own draft_vocab_coverage key wins)")
    p.add_argument("--acceptance-profile", metavar="FILE", default=None,
                   help="--rates and --sibling-rates from an acceptance profile (vllm-bole acceptance-profile)")
    p.add_argument("--depth", type=int, default=8, help="Bole num_speculative_tokens (deepest level)")
    p.add_argument("--topk", type=int, default=4, help="Bole topk")
    p.add_argument("--budget-table", default=DEFAULT_BUDGET_TABLE,
                   help="Bole's calibration table ('' for none: the table-less default, budget_table.default_budget)")
    p.add_argument("--budgets", type=_budget_overrides, default=None, metavar="B=N,...",
                   help="Bole: these node budgets at these batch sizes instead of the table's b_ver (a copy of "
                        "--budget-table with them goes to the log directory), e.g. 16=96,32=192")
    p.add_argument("--calibrate", action="store_true",
                   help="calibrate the budget first, in the first Bole configuration with synchronous scheduling "
                        "(timed first; the other Bole configurations then read the table it wrote)")
    p.add_argument("--calib-kv-lens", type=_ints, default=[256])
    p.add_argument("--calib-nodes", type=_ints, default=[8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024])
    p.add_argument("--calib-epsilon", type=float, default=0.1)
    p.add_argument("--out", default=None, help="results JSON (default benchmarks/results/e2e.json)")
    p.add_argument("--log-dir", default="/tmp/bole-e2e",
                   help="engine logs (default /tmp/bole-e2e; with $OUT set, also packed into $OUT/e2e-logs.tgz)")
    p.add_argument("--profile-batch", type=int, default=None,
                   help="Bole: after the timed runs, one pass at this batch size with the step profiler (phase "
                        "times in the JSON) and one under cProfile (host call tables in the log directory)")
    p.add_argument("--turn-lock", metavar="FILE",
                   help="hold this file's lock over each configuration's timed phase, so that other benchmarks "
                        "sharing the GPU (step_profile.py --turn-lock) measure in turn")
    p.add_argument("--gpus", type=int, default=1,
                   help="spread the configurations over this many GPUs, in the order they run (configuration i on GPU "
                        "i mod N); each GPU gives its turns on its own, at the same time as the others")
    p.add_argument("--smoke", action="store_true", help="CPU: tiny bundled model, tiny grid")
    p.add_argument("--plot-only", action="store_true",
                   help="only draw --out's plot (<out>.png: tok/s and speedup over the best MTP chain by batch "
                        "size) from the results it holds; needs matplotlib")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    return p


def apply_acceptance_profile(args, argv: list[str]) -> None:
    """``--acceptance-profile``: the rates of the profile's ``synthetic_acceptance`` block."""
    if not args.acceptance_profile:
        return
    if any(a.split("=")[0] in ("--rates", "--sibling-rates") for a in argv):
        raise SystemExit("--acceptance-profile sets --rates and --sibling-rates: pass either, not both")
    try:
        rates, siblings = profile_rates(args.acceptance_profile, "--acceptance-profile")
    except BoleConfigError as e:
        raise SystemExit(str(e)) from None
    args.rates, args.sibling_rates = list(rates), list(siblings)


def apply_smoke(args) -> None:
    """The tiny bundled model on CPU with a grid small enough to run end to end in a few minutes (MTP there
    verifies against the target: vLLM's CPU sampler has no synthetic mode)."""
    from vllm_bole.testing.tiny_models import tiny_model_dir

    args.model = args.model or tiny_model_dir("qwen3_5")
    args.batch_sizes, args.prompt_len, args.new_tokens = [1, 2], 16, 16
    args.max_model_len, args.max_num_batched_tokens, args.kv_cache_gib = 256, 256, 0.25
    args.depth, args.topk = 3, 2
    args.min_timed_s, args.min_timed_runs = 0.0, 1   # one timed run per batch size
    # CPU forward times are too noisy for a 10% slack: let every measured N qualify.
    args.calib_kv_lens, args.calib_nodes, args.calib_epsilon = [16], [2, 4, 6], 1000.0
    smoke_dir = Path(os.environ.get("OUT") or "/tmp/bole-e2e-smoke")
    args.out = args.out or str(smoke_dir / "e2e-smoke.json")
    if args.budget_table == DEFAULT_BUDGET_TABLE:   # (a worker gets the driver's, e.g. with --budgets applied)
        args.budget_table = str(smoke_dir / "budget_table-smoke.json")


# ---- one configuration's engine ------------------------------------------------------------------------------
def engine_kwargs(args, name: str) -> dict:
    import torch

    max_b = max(args.batch_sizes)
    kw = {"dtype": "bfloat16", "max_model_len": args.max_model_len, "max_num_seqs": max_b,
          "max_num_batched_tokens": args.max_num_batched_tokens, "enable_prefix_caching": False,
          "kv_cache_memory_bytes": int(args.kv_cache_gib * 2**30), "disable_log_stats": False,
          "skip_tokenizer_init": True, "seed": 0}
    if args.smoke:
        from vllm_bole.testing.tiny_models import engine_kwargs as tiny_kwargs

        kw |= tiny_kwargs("qwen3_5") | {"max_model_len": args.max_model_len, "max_num_seqs": max_b}
    else:
        kw |= {"load_format": "dummy", "gpu_memory_utilization": args.gpu_share,
               "limit_mm_per_prompt": {"image": 0, "video": 0}}
        if torch.cuda.is_available():
            kw["additional_config"] = {"gdn_prefill_backend": "triton"}
    overrides = bole_overrides(name, dict(args.variant))
    if chain_k(name) is not None:
        k = chain_k(name)
        if name.endswith("_sync"):   # how much of the chain's speed is vLLM's async scheduling
            kw["async_scheduling"] = False
        if len(args.rates) < k:
            raise SystemExit(f"--rates: {name} needs {k} rates, got {len(args.rates)}")
        kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k}
        if not args.smoke:  # vLLM's CPU sampler has no synthetic mode: the smoke run verifies against the target
            kw["speculative_config"] |= {"rejection_sample_method": "synthetic",
                                         "synthetic_acceptance_rates": args.rates[:k]}
        sizes = {b * (k + 1) for b in args.batch_sizes} | set(args.batch_sizes)
    elif overrides is not None:
        spec, engine = apply_overrides({
            "method": "bole", "num_speculative_tokens": args.depth, "topk": args.topk, "budget": "auto",
            "budget_table": args.budget_table,
            "synthetic_acceptance": {"rates": args.rates, "sibling_rates": args.sibling_rates, "seed": 0}}, overrides,
            args.draft_vocab_coverage)
        if args.smoke and isinstance(spec.get("draft_vocab"), int):
            # The tiny model's vocabulary has 1024 tokens: half of it, so the smoke run drafts from a subset too.
            spec["draft_vocab"] = 512
        kw["speculative_config"] = spec
        kw |= engine   # e.g. async_scheduling False
        sizes = BOLE_GRAPH_SIZES | set(args.batch_sizes)
    elif name == "ar":
        sizes = set(args.batch_sizes)
    else:
        raise SystemExit(f"--configs: unknown {name}; allowed: {', '.join(allowed_configs(dict(args.variant)))}")
    if not kw.get("enforce_eager"):
        kw["compilation_config"] = {"cudagraph_capture_sizes": sorted(s for s in sizes
                                                                      if s <= args.max_num_batched_tokens)}
    return kw


def schedules_synchronously(name: str, variants: dict[str, dict] | None = None) -> bool:
    """Whether a Bole configuration's engine schedules synchronously on a GPU (pinned, or by the plugin's rules
    for its speculative config)."""
    from vllm_bole.config import parse_bole_config
    from vllm_bole.plugin import config_needs_synchronous

    spec, engine = apply_overrides({"method": "bole"}, bole_overrides(name, variants) or {})
    if engine.get("async_scheduling") is False:
        return True
    cfg, _ = parse_bole_config(spec)
    return config_needs_synchronous(cfg) is not None


def calibrating_config(configs, smoke: bool = False, variants: dict[str, dict] | None = None) -> str | None:
    """The configuration that runs ``--calibrate``: the first Bole one with synchronous scheduling (the sweep steps
    the engine one step at a time; on CPU every one)."""
    return next((n for n in configs if is_bole(n, variants) and (smoke or schedules_synchronously(n, variants))),
                None)


def _wait_for(path: Path, timeout_s: float = 3600.0) -> None:
    start = time.monotonic()
    while not path.exists():
        if os.getppid() == 1 or time.monotonic() - start > timeout_s:
            raise SystemExit(f"gave up waiting for {path}")
        time.sleep(POLL_S)


def _turn_file(run_dir: Path, name: str, b: int, r: int, kind: str) -> Path:
    """A turn's file (``kind`` "go" or "done"): ``<name>.<B>.<kind>`` for a batch size's first round,
    ``<name>.<B>.r<r>.<kind>`` for the others."""
    return run_dir / (f"{name}.{b}.{kind}" if r == 0 else f"{name}.{b}.r{r}.{kind}")


def worker_turns(run_dir: Path, name: str, batch_sizes, rounds: int = 1):
    """The worker's side of the turns: yields (batch size, round) once the parent gave this configuration its
    turn at it (its "go" file), and reports the turn done (its "done" file) when the caller comes back."""
    for b in batch_sizes:
        for r in range(rounds):
            _wait_for(_turn_file(run_dir, name, b, r, "go"))
            yield b, r
            _turn_file(run_dir, name, b, r, "done").touch()


def give_turns(run_dir: Path, procs: dict, order: list[str], batch_sizes, lock_path: str | None = None,
               before=None, rounds: int = 1):
    """The parent's side: batch size by batch size and round by round, each live configuration of ``order`` in
    turn times that batch size while the others wait, so that whatever drifts over a run (clocks, heat, a
    neighbour on the machine) falls on every configuration of a batch size alike. Yields (name, batch size,
    seconds) per finished turn; a worker that exited is skipped from then on. ``before(name)``: called before
    each turn (may wait)."""
    for b in batch_sizes:
        for r in range(rounds):
            for name in order:
                proc = procs[name]
                if proc.poll() is not None:
                    continue
                if before is not None:
                    before(name)
                t = time.monotonic()
                done = _turn_file(run_dir, name, b, r, "done")
                with _turn(lock_path):
                    _turn_file(run_dir, name, b, r, "go").touch()
                    while not done.exists() and proc.poll() is None:
                        time.sleep(POLL_S)
                if done.exists():
                    yield name, b, time.monotonic() - t


def settle_graphs(generate, graph_counts, max_passes: int, clean_needed: int) -> int:
    """Warm-up passes (``generate()``) until ``clean_needed`` in a row left ``graph_counts()`` unchanged (no new
    CUDA graph), at most ``max_passes``; returns the passes run. One clean pass is weak evidence: which shapes a
    pass meets depends on how its batch drains."""
    passes = clean = 0
    while passes < max_passes and clean < clean_needed:
        held = graph_counts()
        generate()
        passes += 1
        clean = clean + 1 if graph_counts() == held else 0
    return passes


def gpu_groups(configs: list[str], gpus: int) -> list[list[str]]:
    """The configurations of each GPU: configuration i on GPU i mod ``gpus``."""
    return [configs[g::gpus] for g in range(gpus) if configs[g::gpus]]


def give_turns_per_gpu(run_dir: Path, procs: dict, groups: list[list[str]], batch_sizes, lock_path=None,
                       calibrating: str | None = None, rounds: int = 1, bole_names=None):
    """:func:`give_turns` on every GPU's configurations at once, one thread per GPU. A Bole configuration
    (``bole_names``; default: the names that start with "bole") waits for the calibrating one's first turn (it
    writes the table the others read), wherever that runs. Returns the finished turns as (name, batch size,
    seconds), each GPU's in its order."""
    import threading

    calibrated = threading.Event()
    if calibrating is None:
        calibrated.set()

    def before(name):
        waits = name in bole_names if bole_names is not None else name.startswith("bole")
        if waits and name != calibrating:
            while not calibrated.wait(POLL_S) and procs[calibrating].poll() is None:
                pass

    turns: list[tuple] = []

    def run(order):
        for name, b, seconds in give_turns(run_dir, procs, order, batch_sizes, lock_path, before, rounds):
            if name == calibrating:
                calibrated.set()
            turns.append((name, b, seconds))
            print(f"{name}: B={b} turn {seconds:.0f} s", flush=True)

    threads = [threading.Thread(target=run, args=(order,), daemon=True) for order in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return turns


@contextlib.contextmanager
def _turn(lock_path: str | None):
    """``--turn-lock``: this file's exclusive lock for the duration (nothing without a path)."""
    if not lock_path:
        yield
        return
    import fcntl

    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write_json(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def run_worker(args) -> None:
    """Start the engine, report ready, wait for the turn, run the timed phase, write the results."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the runner is read in this process
    name, run_dir, variants = args.worker, Path(args.run_dir), dict(args.variant)
    bole = is_bole(name, variants)
    from vllm import LLM, SamplingParams
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity

    from vllm_bole.spec_decode.budget_table import device_name
    from vllm_bole.testing.greedy_check import spec_decode_counters

    from engine_steps import EngineSteps, combine, summarize

    kwargs = engine_kwargs(args, name)
    t0 = time.perf_counter()
    llm = LLM(model=args.model, **kwargs)
    startup_s = time.perf_counter() - t0
    runner = model_runner_of(llm)
    steps = EngineSteps(llm)   # each timed run's phases: prefill, full-batch steps, the draining tail
    _, concurrency = get_kv_cache_capacity(runner.vllm_config, runner.kv_cache_config)
    result = {"config": name, "gpu": device_name(), "startup_s": round(startup_s, 1),
              "concurrency": round(concurrency, 2), "concurrency_tokens_per_request": args.max_model_len,
              "kv_cache_gib": args.kv_cache_gib, "gpu_memory_utilization": kwargs.get("gpu_memory_utilization"),
              "kv_cache_blocks": runner.kv_cache_config.num_blocks,
              "speculative_config": kwargs.get("speculative_config"),
              "settings": {k: getattr(args, k) for k in ("prompt_len", "new_tokens", "warmup_tokens", "warmup_passes",
                                                        "settle_passes",
                                                        "rates", "sibling_rates", "acceptance_profile",
                                                        "model")}}
    if bole:   # the keys over bole's speculative config (its table's title)
        result["variant"] = bole_overrides(name, variants)
    _write_json(run_dir / f"{name}.ready", {"startup_s": result["startup_s"]})
    turns = worker_turns(run_dir, name, args.batch_sizes, args.rounds)
    first = next(turns)   # the first turn also calibrates (or reads the table the calibrating engine wrote)

    if args.calibrate and name == calibrating_config(args.configs, args.smoke, variants):
        from vllm_bole.calibration.sweep import SweepPlan, calibrate, plot, save, summary

        plan = SweepPlan(batch_sizes=args.batch_sizes, kv_lens=args.calib_kv_lens, nodes=args.calib_nodes,
                         epsilon=args.calib_epsilon, warmup=2 if args.smoke else 3, steps=3 if args.smoke else 10)
        t = time.perf_counter()
        entries = calibrate(llm, plan, progress=False)
        save(entries, args.budget_table)
        print(summary(entries), flush=True)
        plot(entries, run_dir / "calibration.png")
        result["calibration"] = entries
        result["calibration_s"] = round(time.perf_counter() - t, 1)
    elif args.calibrate and bole:
        # Timed after the calibrating engine (run_configs orders the turns): read the table it wrote.
        from vllm_bole.spec_decode.budget import reload_budget_tables

        reload_budget_tables()
    if args.calibrate and bole:
        # The rule "throughput" applies only where the table holds curves: resolve it again with the new table.
        runner.bole_budget.refresh()
        scheduler = engine_core_of(llm).scheduler
        if hasattr(scheduler, "bole_refresh_budget_rule"):   # (the async scheduler; the synchronous one asks none)
            scheduler.bole_refresh_budget_rule()

    rng = random.Random(0)
    vocab = runner.model_config.get_vocab_size()
    per_batch = {}
    # Per round of a batch size the timed runs' share of the minimums (tok/s is the median over all rounds).
    min_runs, max_runs = -(-args.min_timed_runs // args.rounds), max(1, -(-args.max_timed_runs // args.rounds))
    min_s = args.min_timed_s / args.rounds
    for b, r in itertools.chain([first], turns):
        if r == 0:   # the batch size's first round: warm up, then count from here
            prompts = [{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(args.prompt_len)]}
                       for _ in range(b)]
            warm = SamplingParams(max_tokens=args.warmup_tokens or args.new_tokens, ignore_eos=True,
                                  temperature=0.0, detokenize=False)
            for _ in range(args.warmup_passes):   # Bole captures its graphs on first use of each shape
                llm.generate(prompts, warm, use_tqdm=False)
            # Tree steps take many shapes (token counts, request buckets, attention routes): warm up until a pass
            # meets no new one, as a serving engine soon does, so that the timed runs measure the steady state.
            settle = 0
            if bole:
                settle = settle_graphs(lambda: llm.generate(prompts, warm, use_tqdm=False),
                                       lambda: _bole_graph_counts(runner), args.settle_passes, args.settle_clean)
            params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True, temperature=0.0, detokenize=False)
            before = spec_decode_counters(llm.get_metrics())
            graphs_before, keys_before = _bole_graph_counts(runner), _bole_graph_keys(runner)
            stand_ins_before, capture_ms_before = _bole_stand_ins(runner), _bole_capture_ms(runner)
            budgets_before = collections.Counter(runner.bole_budget.planned if bole else {})
            chains_before = runner.step_counts()["chain_steps"] if bole else 0
            runs, wall, tokens, round_runs, step_summaries = [], 0.0, 0, [], []
        # Timed runs repeat until --min-timed-s of wall time (a batch-1 run lasts about a second), at least
        # --min-timed-runs times, so that the median leaves out a run that captured a graph or compiled a kernel;
        # tok/s is their median, the acceptance counters cover them all. With --rounds, each round runs its share
        # (the engine is idle between its rounds, while the other configurations take theirs).
        mine, round_wall = [], 0.0
        while len(mine) < min_runs or round_wall < min_s and len(mine) < max_runs:
            t = time.perf_counter()
            with steps.run() as logged:
                outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - t
            step_summaries.append(summarize(logged, b))
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            mine.append(n / elapsed)
            round_wall, wall, tokens = round_wall + elapsed, wall + elapsed, tokens + n
        runs += mine
        round_runs.append(round(statistics.median(mine), 1))
        if r < args.rounds - 1:
            continue
        graphs_after = _bole_graph_counts(runner)
        after = spec_decode_counters(llm.get_metrics())
        drafts = after["num_drafts"] - before["num_drafts"]
        accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
        row = {"tok_s": round(statistics.median(runs), 1), "tok_s_runs": [round(x, 1) for x in runs],
               "wall_s": round(wall, 3), "tokens": tokens,
               "mean_accepted": round(1 + accepted / drafts, 3) if drafts else None,
               "draft_tokens_per_step": round((after["num_draft_tokens"] - before["num_draft_tokens"]) / drafts, 2)
               if drafts else None}
        if args.rounds > 1:
            row["tok_s_rounds"] = round_runs   # each round's median, in round order
        row["engine_steps"] = combine(step_summaries)   # medians over the timed runs (engine_steps.summarize)
        if bole:
            # the node budget the timed runs' steps of all B requests took most often (the rules "step" and
            # "throughput" move it with their measurements)
            planned = runner.bole_budget.planned - budgets_before
            at_b = {n: c for (reqs, n), c in planned.items() if reqs == b}
            row["budget"] = max(at_b, key=at_b.get) if at_b else None
            row["budgets_at_b"] = dict(sorted(at_b.items()))
            # Bole captures its full graphs lazily: captures inside the timed run are part of its wall time.
            row["graphs_captured_in_timed_run"] = [a - b for a, b in zip(graphs_after, graphs_before)]
            # which shapes they were (the shapes the warm-up and settle passes did not meet)
            row["graph_keys_captured_in_timed_run"] = {
                kind: sorted(keys - keys_before.get(kind, set())) for kind, keys in _bole_graph_keys(runner).items()
                if keys - keys_before.get(kind, set())}
            row["graphs_held"] = list(graphs_after)
            # steps of a shape not held yet that replayed a held graph of a few more tokens instead
            row["stand_in_replays_in_timed_run"] = [a - b for a, b in zip(_bole_stand_ins(runner), stand_ins_before)]
            # drafting steps that grew a one-wide beam (chains: docs/design.md, "Chain steps")
            row["chain_steps_in_timed_run"] = runner.step_counts()["chain_steps"] - chains_before
            # what those captures cost the timed runs (verification, drafter level, beam level, chain level), in ms
            # of host time
            spent = [a - b for a, b in zip(_bole_capture_ms(runner), capture_ms_before)]
            row["capture_ms_in_timed_run"] = [round(x, 1) for x in spent]
            row["capture_share_of_wall"] = round(sum(spent) / 1e3 / wall, 4) if wall else None
            row["settle_passes"] = settle
            # what the throughput rule weighed at the end (per calibrated N: T_ver, rest, tokens, their rate)
            estimates = runner.bole_budget.estimates(b)
            if estimates is not None:
                row["rule_estimates"] = estimates
            # the step clock's fit of the rest against the tree size (its slope: None while unknown; the stalls
            # it left out)
            fit = runner.bole_budget.clock.fit_summary(b)
            if fit is not None:
                row["rest_fit"] = fit
        per_batch[str(b)] = row
        print(f"[{name}] B={b}: {row}", flush=True)
        if b == args.batch_sizes[-1]:   # the rest of the last turn: the profile, the results
            result["batches"] = per_batch
            if bole:   # the budget rule in effect (budget.with_applicable_rule)
                result["budget_rule"] = runner.bole_budget.rule
            if bole and args.profile_batch:
                result["profile"] = profile_bole(llm, runner, args, run_dir, rng, name)
            _write_json(run_dir / f"{name}.json", result)


def _bole_graph_counts(runner) -> tuple[int, int]:
    """(verification graphs, drafter graphs: level and whole-level) a Bole runner holds; zeros for other
    engines."""
    counts = getattr(runner, "bole_graph_counts", None)
    return counts() if counts is not None else (0, 0)


def _bole_graph_holders(runner) -> dict:
    """A Bole runner's holders of CUDA graphs by kind ("verify", "draft": drafter levels, "beam": whole drafter
    levels, "chain": whole levels of one-wide steps), None where it has none (other engines: all)."""
    drafter = getattr(runner, "bole_drafter", None)
    return {"verify": getattr(runner, "_bole_graphs", None), "draft": getattr(drafter, "graphs", None),
            "beam": getattr(getattr(drafter, "beam", None), "graphs", None),
            "chain": getattr(getattr(drafter, "chain", None), "graphs", None)}


def _bole_stand_ins(runner) -> tuple[int, int]:
    """(verification, drafter level) replays so far of a larger held graph standing in for a key not held yet
    (``attention/graph_mode.stand_in``); zeros for other engines."""
    holders = _bole_graph_holders(runner)
    return tuple(h.stand_ins.replays if hasattr(h, "stand_ins") else 0 for h in (holders["verify"], holders["draft"]))


def _bole_capture_ms(runner) -> tuple[float, ...]:
    """(verification, drafter level, drafter beam level, chain level) host milliseconds spent capturing CUDA graphs
    so far (eager warm-up, synchronize and capture: what a step that captures waits); zeros for other engines."""
    return tuple(float(getattr(h, "capture_ms", 0.0)) for h in _bole_graph_holders(runner).values())


def _bole_graph_keys(runner) -> dict[str, set]:
    """The keys of every graph a Bole runner holds, by kind ("verify": (padded tokens, request bucket, long
    prefix); "draft": (padded tokens, request bucket, long prefix, rows per request); "beam": (request bucket,
    level, long prefix)) as lists; empty for other engines."""
    return {kind: {tuple(int(x) if isinstance(x, (bool, int)) else x for x in key) for key in h.graphs}
            for kind, h in _bole_graph_holders(runner).items() if h is not None}


def profile_bole(llm, runner, args, run_dir: Path, rng, name: str = "bole") -> dict:
    """Phase means of ``--profile-batch`` requests (``vllm_bole/worker/step_profile.py``; synchronizing, so
    slower than the timed runs), then the same under cProfile: ``host_<config>_B<b>.txt`` in the run's log
    directory; each after a pass of the same requests run the same way, which captures the graphs of their
    shapes."""
    import cProfile
    import io
    import pstats

    from vllm import SamplingParams

    from vllm_bole.worker.step_profile import StepProfiler

    b, vocab = args.profile_batch, runner.model_config.get_vocab_size()
    prompts = [{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(args.prompt_len)]} for _ in range(b)]
    params = SamplingParams(max_tokens=min(args.new_tokens, 96), ignore_eos=True, temperature=0.0, detokenize=False)
    # Each measured pass after one the same way, unmeasured: it meets no step shape whose graph is still to be
    # captured (the phase timer also takes other paths: no drafting before the walk).
    for profiler in (StepProfiler(1 << 30), StepProfiler(1 << 30)):   # one mean over the whole pass
        runner._bole_profiler = profiler
        llm.generate(prompts, params, use_tqdm=False)
    runner._bole_profiler = None
    phases = profiler.means()
    llm.generate(prompts, params, use_tqdm=False)
    prof = cProfile.Profile()
    prof.enable()
    llm.generate(prompts, params, use_tqdm=False)
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("cumulative").print_stats(90)
    stats.sort_stats("tottime").print_stats(60)
    (run_dir / f"host_{name}_B{b}.txt").write_text(text.getvalue())
    steps = profiler.steps["trees"]
    print(f"[bole] profile B={b} ({steps} tree-only steps): {phases}", flush=True)
    return {"batch_size": b, "tree_steps": steps, "phases_ms": {k: round(v, 3) for k, v in phases.items()}}


# ---- the driver ----------------------------------------------------------------------------------------------
def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def run_configs(args, argv: list[str], out: Path) -> dict[str, dict]:
    """Start one worker per configuration at once, then give each its timed turn, merging each result into
    ``out`` as soon as it is in; returns results by name."""
    run_dir = Path(args.log_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for f in run_dir.glob("*"):
        # an earlier run's turn files and results of these configurations (<name>.<B>.go, <name>.json, ...)
        if f.suffix in (".ready", ".go", ".done", ".json") and any(f.name.startswith(f"{n}.") for n in args.configs):
            f.unlink()
    # Which invocation each merged configuration comes from: configurations of one run were timed side by side.
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    procs = {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(args.gpus)))).split(",")
    for i, name in enumerate(args.configs):
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1",
                   VLLM_CACHE_ROOT=str(Path(os.environ.get("VLLM_CACHE_ROOT", Path.home() / ".cache/vllm"))
                                       / f"e2e-{name}"))
        if args.gpus > 1:   # (gpu_groups: configuration i on GPU i mod N)
            env["CUDA_VISIBLE_DEVICES"] = visible[i % args.gpus]
        log = open(run_dir / f"{name}.log", "w")
        procs[name] = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *argv, "--worker", name,
                                        "--run-dir", str(run_dir)], stdout=log, stderr=subprocess.STDOUT, env=env)
    t0 = time.monotonic()
    waiting = set(procs)
    while waiting:
        for name in sorted(waiting):
            if (run_dir / f"{name}.ready").exists() or procs[name].poll() is not None:
                waiting.discard(name)
                state = "ready" if procs[name].poll() is None else f"exited rc={procs[name].returncode}"
                print(f"{name}: {state} after {time.monotonic() - t0:.0f} s", flush=True)
        time.sleep(POLL_S)
    results, variants = {}, dict(args.variant)
    calibrating = calibrating_config(args.configs, args.smoke, variants) if args.calibrate else None
    # Timed phases one engine at a time per GPU; at each batch size the calibrating one first (its first turn
    # calibrates), and the other Bole engines wait for its table.
    order = sorted(args.configs, key=lambda n: n != calibrating)
    for name in order:
        if procs[name].poll() is not None:
            print(f"{name}: failed during start-up; log tail:\n{_tail(run_dir / f'{name}.log')}", flush=True)
    groups = [sorted(g, key=lambda n: n != calibrating) for g in gpu_groups(args.configs, args.gpus)]
    give_turns_per_gpu(run_dir, procs, groups, args.batch_sizes, args.turn_lock, calibrating, args.rounds,
                       {n for n in args.configs if is_bole(n, variants)})
    for name in order:
        proc = procs[name]
        proc.wait()
        result = run_dir / f"{name}.json"
        if proc.returncode == 0 and result.exists():
            results[name] = json.loads(result.read_text()) | {"run": started}
            merge_and_write(out, {name: results[name]}, args)
        else:
            print(f"{name}: failed rc={proc.returncode}; log tail:\n{_tail(run_dir / f'{name}.log')}", flush=True)
    if os.environ.get("OUT"):   # a GPU machine's output folder takes few files: the logs as one archive
        import tarfile

        with tarfile.open(Path(os.environ["OUT"]) / "e2e-logs.tgz", "w:gz") as tar:
            for name in args.configs:
                for suffix in (".log", ".json"):
                    if (run_dir / f"{name}{suffix}").exists():
                        tar.add(run_dir / f"{name}{suffix}", arcname=f"{name}{suffix}")
    return results


def async_chains(configs: dict[str, dict]) -> list[str]:
    """The MTP chain configurations the best chain is picked from (the synchronous ``*_sync`` ones are reported
    beside it, not counted)."""
    return [n for n in configs if is_chain(n)]


def ran_bole(name: str, config: dict) -> bool:
    """Whether a results file's configuration ran Bole (its recorded speculative config; by name where none is
    recorded)."""
    spec = config.get("speculative_config")
    return spec.get("method") == "bole" if isinstance(spec, dict) else name.startswith("bole")


def bole_results(configs: dict[str, dict]) -> list[str]:
    """A results file's Bole configurations: ``bole``, the named variants in their order, then the others (those
    of ``--variant``, or no longer offered) as they came."""
    order = ["bole", *BOLE_VARIANTS]
    return sorted((n for n, c in configs.items() if ran_bole(n, c)),
                  key=lambda n: order.index(n) if n in order else len(order))


def build_rows(configs: dict[str, dict]) -> list[dict]:
    batch_sizes = sorted({int(b) for c in configs.values() for b in c["batches"]})

    def tok_s(name, b):
        return configs.get(name, {}).get("batches", {}).get(str(b), {}).get("tok_s")

    def ratio(a, b):
        return round(a / b, 3) if a and b else None

    # Every Bole configuration holds the same KV cache; the default's figure, else the first variant's.
    bole_names = bole_results(configs)
    bole_concurrency = configs[bole_names[0]].get("concurrency") if bole_names else None
    rows = []
    for b in batch_sizes:
        chains = async_chains(configs)
        mtp = {int(n[3:]): tok_s(n, b) for n in chains if tok_s(n, b)}
        best_k = max(mtp, key=mtp.get) if mtp else None
        bole = configs.get("bole", {}).get("batches", {}).get(str(b), {})
        gpu = next((c["gpu"] for c in configs.values()), None)
        rows.append({
            "B": b, "ar_tok_s": tok_s("ar", b), "mtp_best_k": best_k, "mtp_best_tok_s": mtp.get(best_k),
            "bole_tok_s": bole.get("tok_s"), "bole_mean_accepted": bole.get("mean_accepted"),
            "speedup_vs_mtp": ratio(bole.get("tok_s"), mtp.get(best_k)),
            "speedup_vs_ar": ratio(bole.get("tok_s"), tok_s("ar", b)),
            "concurrency_ar": configs.get("ar", {}).get("concurrency"),
            "concurrency_mtp": configs[f"mtp{best_k}"]["concurrency"] if best_k else None,
            "concurrency_bole": bole_concurrency, "gpu": gpu,
            "mtp_tok_s_by_k": {str(k): v for k, v in sorted(mtp.items())},
            "mtp_mean_accepted_by_k": {n[3:]: configs[n]["batches"].get(str(b), {}).get("mean_accepted")
                                       for n in sorted(chains)},
            "bole_budget": bole.get("budget"),
            "bole_draft_tokens_per_step": bole.get("draft_tokens_per_step")})
        sync = {n: tok_s(n, b) for n in configs if n.startswith("mtp") and n.endswith("_sync") and tok_s(n, b)}
        if sync:   # the chain without async scheduling (Bole schedules synchronously)
            rows[-1]["mtp_sync_tok_s_by_k"] = {n[3:].removesuffix("_sync"): v for n, v in sorted(sync.items())}
        for variant in (n for n in bole_names if n != "bole"):   # e.g. budget_rule "step" beside bole
            v = configs[variant].get("batches", {}).get(str(b))
            if v:
                rows[-1] |= {f"{variant}_tok_s": v.get("tok_s"), f"{variant}_mean_accepted": v.get("mean_accepted"),
                             f"{variant}_budget": v.get("budget"),
                             f"{variant}_speedup_vs_mtp": ratio(v.get("tok_s"), mtp.get(best_k))}
    return rows


def markdown(rows: list[dict], variants: dict[str, dict] | None = None) -> str:
    """The rows as tables: AR, the best chain and ``bole``, then one table per other Bole configuration, titled by
    its keys over ``bole`` (``variants``, e.g. those the results recorded; else ``BOLE_VARIANTS``)."""
    def f(v, spec=".0f"):
        return "–" if v is None else format(v, spec)

    lines = ["| B | AR tok/s | best MTP (k) tok/s | Bole tok/s | Bole tokens/step | budget | vs MTP | vs AR |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['B']} | {f(r['ar_tok_s'])} | {f(r['mtp_best_tok_s'])} (k={r['mtp_best_k'] or '–'}) | "
                     f"{f(r['bole_tok_s'])} | {f(r['bole_mean_accepted'], '.2f')} | {r['bole_budget'] or '–'} | "
                     f"{f(r['speedup_vs_mtp'], '.2f')}× | {f(r['speedup_vs_ar'], '.2f')}× |")
    if any("mtp_sync_tok_s_by_k" in r for r in rows):
        lines += ["", "vLLM MTP with async_scheduling false (tok/s by k): " + "; ".join(
            f"B={r['B']}: " + ", ".join(f"k={k} {v:.0f}" for k, v in r.get("mtp_sync_tok_s_by_k", {}).items())
            for r in rows)]
    suffix = "_speedup_vs_mtp"   # (a Bole configuration's field; the rows' own is "speedup_vs_mtp")
    for variant in dict.fromkeys(k.removesuffix(suffix) for r in rows for k in r if k.endswith(suffix)):
        keys = (variants or {}).get(variant, BOLE_VARIANTS.get(variant))   # e.g. async_scheduling False
        title = ", ".join(f"{k} {v!r}" for k, v in (keys or {}).items()).replace("'", '"')
        lines += ["", f"Bole with {title} ({variant}):" if title else f"Bole ({variant}):",
                  "| B | tok/s | tokens/step | budget (most steps) | vs MTP |", "|---|---|---|---|---|"]
        lines += [f"| {r['B']} | {f(r.get(f'{variant}_tok_s'))} | {f(r.get(f'{variant}_mean_accepted'), '.2f')} | "
                  f"{r.get(f'{variant}_budget') or '–'} | {f(r.get(f'{variant}_speedup_vs_mtp'), '.2f')}× |"
                  for r in rows]
    if rows:
        r = rows[0]
        lines.append(f"Max concurrency (requests of the concurrency length): AR {r['concurrency_ar']}, "
                     f"MTP {r['concurrency_mtp']}, Bole {r['concurrency_bole']}")
    return "\n".join(lines)


def steps_markdown(configs: dict[str, dict]) -> str:
    """Per configuration and batch size, the timed runs' phases (``engine_steps`` in each batch entry, medians
    over the runs): prefill, the steps with the whole batch decoding (count, median period, tok/s over them) and
    the draining tail; "vs MTP": the full-batch tok/s over the best async MTP chain's at that batch size."""
    def f(v, spec=".1f"):
        return "–" if v is None else format(v, spec)

    def full_tok_s(name, b):
        return ((configs[name].get("batches", {}).get(b) or {}).get("engine_steps") or {}).get("full_tok_s")

    batch_sizes = {b for c in configs.values() for b in c.get("batches", {})}
    best = {b: max((v for v in (full_tok_s(n, b) for n in async_chains(configs)) if v), default=None)
            for b in batch_sizes}
    lines = ["| config | B | steps | prefill ms | full-batch steps | full-batch step ms | full-batch tok/s | vs MTP | "
             "tail steps | tail ms | tail step ms |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in sorted(configs, key=lambda n: (not n.startswith("mtp"), n)):
        for b, row in sorted(configs[name].get("batches", {}).items(), key=lambda kv: int(kv[0])):
            s = row.get("engine_steps")
            if s:
                ratio = s["full_tok_s"] / best[b] if best[b] and s["full_tok_s"] else None
                lines.append(f"| {name} | {b} | {f(s['steps'], '.0f')} | {f(s['prefill_ms'])} | "
                             f"{f(s['full_steps'], '.0f')} | {f(s['full_step_ms'], '.2f')} | "
                             f"{f(s['full_tok_s'], '.0f')} | {f(ratio, '.2f')}× | {f(s['tail_steps'], '.0f')} | "
                             f"{f(s['tail_ms'])} | {f(s.get('tail_step_ms'), '.2f')} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def merge_and_write(out: Path, results: dict[str, dict], args) -> dict:
    data = json.loads(out.read_text()) if out.exists() else {}
    configs = {**data.get("configs", {}), **results}
    calibrated = [c for c in configs.values() if c.get("calibration")]   # the latest run's, if several
    calibration = max(calibrated, key=lambda c: c.get("run") or "")["calibration"] if calibrated else None
    data = {
        "benchmark": "e2e decode throughput (benchmarks/e2e.py)",
        "acceptance": {"unconditional_rates": args.rates, "bole_sibling_rates": args.sibling_rates,
                       "profile": args.acceptance_profile},
        "concurrency_note": ("vLLM's maximum concurrency for concurrency_tokens_per_request tokens per request, "
                             "per configuration at its fixed KV cache (configs.*.kv_cache_gib)"),
        "rows": build_rows(configs),
        "configs": configs,
        "calibration": [{k: e[k] for k in ("batch_size", "kv_len", "t_dec_ms", "b_ver", "epsilon", "points")}
                        for e in calibration] if calibration else None,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    _write_json(out, data)
    return data


# The issue's targets for Bole against the best MTP chain, by batch size (the plot marks them).
TARGETS = {1: 1.5, 8: 1.3, 16: 1.3, 32: 1.3, 64: 1.0}


def plot_series(data: dict) -> dict:
    """What the plot draws from a results file: ``tok_s``, per configuration, [(B, tok/s)] in batch order;
    ``speedup_vs_best_mtp``, per Bole configuration, [(B, its tok/s over the best MTP chain's at that B)] where a
    chain ran (the rows' ``mtp_best_tok_s``, :func:`build_rows`)."""
    configs = data.get("configs", {})
    tok_s = {}
    for name, config in configs.items():
        points = sorted((int(b), r["tok_s"]) for b, r in config.get("batches", {}).items() if r.get("tok_s"))
        if points:
            tok_s[name] = points
    best = {r["B"]: r["mtp_best_tok_s"] for r in build_rows(configs) if r["mtp_best_tok_s"]} if configs else {}
    speedup = {name: [(b, round(v / best[b], 3)) for b, v in points if b in best]
               for name, points in tok_s.items() if ran_bole(name, configs[name])}
    return {"tok_s": tok_s, "speedup_vs_best_mtp": {n: p for n, p in speedup.items() if p}}


def plot_results(data: dict, path: Path) -> bool:
    """Two panels at ``path``: tok/s by batch size per configuration, and each Bole configuration over the best
    MTP chain with the issue's targets marked. False when matplotlib is missing (it is not a dependency)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    series = plot_series(data)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    color = {name: f"C{i}" for i, name in enumerate(series["tok_s"])}   # one colour per configuration in both
    for name, points in series["tok_s"].items():
        left.plot(*zip(*points), marker="o", label=name, color=color[name])
    for name, points in series["speedup_vs_best_mtp"].items():
        right.plot(*zip(*points), marker="o", label=name, color=color[name])
    sizes = sorted({b for points in series["tok_s"].values() for b, _ in points})
    right.axhline(1.0, color="gray", linestyle=":", linewidth=1)
    right.scatter(list(TARGETS), list(TARGETS.values()), marker="_", s=300, color="black", label="target")
    configs = list(data.get("configs", {}).values())
    gpu = next((c["gpu"] for c in configs if c.get("gpu")), "")
    model = next((Path(c["settings"]["model"]).name for c in configs if c.get("settings", {}).get("model")), "")
    for ax, label in ((left, "output tokens/s"), (right, "tok/s over the best MTP chain")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set_xlabel("batch size (requests)")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    left.set_title(", ".join(x for x in (gpu, model) if x))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _plot(out: Path, data: dict) -> None:
    png = out.with_suffix(".png")
    if plot_results(data, png):
        print(f"wrote {png}")
    else:
        print("no plot: matplotlib is not installed")


def parse_args(argv: list[str]):
    """The options, ``--configs`` as the list of configurations in the order they run (an unknown name: a one-line
    error)."""
    args = build_parser().parse_args(argv)
    if args.budget_table == "":   # no table: the engines read a path that holds none (and say so in their logs)
        if args.budgets or args.calibrate:
            raise SystemExit("--budget-table '': --budgets and --calibrate need a table path")
        args.budget_table = str(Path(args.log_dir) / NO_BUDGET_TABLE)
    variants = dict(args.variant)
    args.configs = run_order(config_names(args.configs, variants), variants)
    if args.worker:
        config_names(args.worker, variants)
    return args


def variant_keys(configs: dict[str, dict]) -> dict[str, dict]:
    """The keys over ``bole`` each Bole configuration of a results file recorded (``variant``)."""
    return {n: c["variant"] for n, c in configs.items() if isinstance(c.get("variant"), dict)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    apply_acceptance_profile(args, argv)
    if args.plot_only:
        out = Path(args.out or ROOT / "benchmarks/results/e2e.json")
        _plot(out, json.loads(out.read_text()))
        return 0
    if args.smoke:
        apply_smoke(args)
    if args.model is None:
        found = [p for p in MODEL_CANDIDATES if (p / "config.json").exists()]
        if not found:
            raise SystemExit(f"--model: none of {[str(p) for p in MODEL_CANDIDATES]} exists; pass --model")
        args.model = str(found[0])
    if args.worker:
        run_worker(args)
        return 0
    if args.gpus < 1 or args.gpus > 1 and args.turn_lock:
        raise SystemExit("--gpus: at least 1, and 1 with --turn-lock (one lock is one GPU's)")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if args.gpus > 1 and visible is not None and len(visible.split(",")) < args.gpus:
        raise SystemExit(f"--gpus {args.gpus}: CUDA_VISIBLE_DEVICES={visible!r} names fewer GPUs")
    per_gpu = max(len(g) for g in gpu_groups(args.configs, args.gpus))
    if not args.smoke and per_gpu * args.gpu_share > 1:
        raise SystemExit(f"--gpu-share: {per_gpu} engines x {args.gpu_share} of one GPU's memory is more than all "
                         f"of it; lower --gpu-share, run fewer --configs, or spread them with --gpus")
    if args.calibrate and not args.smoke and calibrating_config(args.configs, variants=dict(args.variant)) is None:
        raise SystemExit("--calibrate: --configs needs a Bole configuration that schedules synchronously (e.g. "
                         "bole_sync, bole_vocab32k_sync, bole_global, bole_step)")
    if args.budgets:
        args.budget_table = str(override_budgets(Path(args.budget_table), args.budgets, Path(args.log_dir)))
        print(f"budgets {args.budgets} over the table's: {args.budget_table}", flush=True)
    forwarded = [a for a in argv if a != "--smoke"] + (["--smoke"] if args.smoke else [])
    forwarded += ["--model", args.model, "--budget-table", args.budget_table]
    out = Path(args.out or ROOT / "benchmarks/results/e2e.json")
    results = run_configs(args, forwarded, out)
    data = merge_and_write(out, {}, args)
    print(markdown(data["rows"], variant_keys(data["configs"])))
    if table := steps_markdown(data["configs"]):
        print("\nTimed runs by phase (medians over the runs):\n" + table)
    print(f"wrote {out} ({', '.join(sorted(data['configs']))})")
    _plot(out, data)
    return 0 if len(results) == len(args.configs) else 1


if __name__ == "__main__":
    sys.exit(main())
