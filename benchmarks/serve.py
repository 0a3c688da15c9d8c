#!/usr/bin/env python3
"""Online serving: vLLM's OpenAI server per configuration, driven by vLLM's own serving client over request rates.

    python3 benchmarks/serve.py --smoke                                   # CPU: tiny Qwen3.5, ar and bole, ~3 min
    python3 benchmarks/serve.py --configs ar,mtp1,mtp2,mtp3,mtp4,bole --request-rates 1,2,4,8,16,32,inf \\
        --input-len 1024 --output-len 256 --num-prompts 128 --max-num-seqs 128 --kv-cache-gib 40 \\
        --goodput ttft:1000 tpot:30 --plot                                # GPU, the 9B shape (dummy weights)

For each configuration of ``--configs``, one at a time, it starts ``python -m vllm.entrypoints.openai.api_server``
(``benchmarks/soak.py``'s ``start_server``) with the same server arguments except the speculative config, sends
warm-up loads that are not recorded (``--warmup-prompts`` at rate inf, then ``--warmup-concurrency``'s small
batches), then runs vLLM's ``vllm bench serve`` client (``vllm.benchmarks.serve``, in process) once per rate of ``--request-rates`` (requests per second, Poisson
arrivals, ``--burstiness`` 1; ``inf`` sends all ``--num-prompts`` at once: the server's saturation) on the
``random`` dataset (``--input-len``, ``--output-len``, ``--random-range-ratio``; ``ignore_eos``, ``--temperature``
0), and stops the server. Every configuration sees the same prompts and arrival times at a rate (same seed).

Configurations:

* ``ar``: no speculation;
* ``mtp1`` .. ``mtp8``: vLLM's MTP chain of k drafts with ``rejection_sample_method: "synthetic"`` and the first
  k of ``--rates`` (vLLM's CPU sampler has no synthetic mode: on CPU MTP verifies against the target);
  ``mtp1_sync`` .. ``mtp8_sync``: the chain with ``--no-async-scheduling`` (not counted as the best chain);
* ``bole``: the default ``{"method": "bole"}`` (8 levels, top-4, budget "auto", draft_vocab "auto") with
  ``synthetic_acceptance`` (``--rates`` and ``--sibling-rates``; ``--draft-vocab-coverage`` for the draft
  vocabulary) and ``budget_table: --budget-table`` (e2e.py's default table; ``""``: Bole's own lookup);
* Bole's named variants of ``benchmarks/e2e.py`` (``BOLE_VARIANTS``: ``bole_global``, ``bole_step``,
  ``bole_vocab32k``, ``bole_full_vocab``, ``bole_decode_vocab32k``, ``bole_late``, ``bole_vllm_kv_groups``,
  ``bole_cold``, ``bole_sync``, ``bole_vocab32k_sync``, ``bole_measured``), ``--variant NAME=JSON`` (keys merged
  into ``bole``'s speculative config, null as the config reads it;
  ``async_scheduling`` true/false goes to the server's flag instead), or inline ``bole:{"budget_rule": "decode"}``
  inside ``--configs`` (its name is the text as given). The names and their settings are e2e.py's
  (``config_names``, ``bole_overrides``); an unknown name exits with one line that lists the allowed ones.

Acceptance, the same for both methods (as e2e.py): ``--rates`` are per-position unconditional rates of the rank-1
chain (vLLM's convention); MTP k gets the first k, Bole all of them plus ``--sibling-rates`` for rank-2.. children,
so a one-wide Bole tree accepts exactly like the chain. ``--acceptance real`` verifies against the model instead
(meaningless on dummy weights).

Model: ``--model`` (default ``benchmarks/models/qwen3.5-9b-shape``); a folder without weight files is served with
``--load-format dummy``; a ``*ForConditionalGeneration`` folder with ``--language-model-only``. Tokenizer: the
client makes its random prompts with a tokenizer and the server reads them with the same one; a model folder
without tokenizer files gets one built offline for its vocabulary (``synthetic_tokenizer``: a word-level
tokenizer with one word per token id, ``t<id>``, the config's special token ids as special tokens; prompts
decode and re-encode to exactly their token ids), cached under ``$VLLM_BOLE_CACHE`` or ``~/.cache/vllm-bole``.

Output: ``--out`` (default ``benchmarks/results/serve.json``; ``--smoke``: ``$OUT/serve-smoke.json`` or
``/tmp/bole-serve-smoke/``) holds ``rows`` (one per configuration and rate: TTFT / TPOT / ITL / E2EL mean, p50, p90,
p99 in ms, output and total tok/s, request throughput, goodput with ``--goodput``, spec-decode acceptance length and
rate, completed and failed requests; with ``VLLM_BOLE_SLOW_STEP_MS`` set for the servers, the steps they logged as
slow and their step times by kind of step), ``configs`` (each one's speculative config, server command, start time
and what Bole's start-up warm-up ran in it, the Bole budget lines of its log, the run it came from) and ``runs``
(each invocation's exact command and commit). Rows of configurations that this invocation did not run are kept when
the workload (model, lengths, prompts, rates, acceptance) is the same, so one table can be filled by several
invocations (``--fresh``: start over). Printed: per rate, each configuration's TPOT p50 and output tok/s and each
Bole configuration's ratios against the best MTP chain at that rate (TPOT: Bole / the chain with the lowest TPOT
p50, below 1 is better; tok/s: Bole / the chain with the most tok/s, above 1 is better; against ``ar`` when no chain
ran), then a table of TTFT, ITL and acceptance. ``--plot`` draws ``<out>.png`` (matplotlib, if installed). Server
logs and the client's printout go to ``--log-dir`` (default: a temporary folder; with ``$OUT`` set,
``$OUT/serve-logs``).
Exit status 1 when a server did not start or any row has failed or missing requests.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import math
import os
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import soak  # noqa: E402
from e2e import (DEFAULT_BUDGET_TABLE, DEFAULT_CONFIGS, DEFAULT_DRAFT_VOCAB_COVERAGE, MODEL_CANDIDATES,  # noqa: E402
                 apply_overrides, bole_overrides, chain_k, is_bole, is_chain, parse_variant)
from e2e import config_names as _config_names  # noqa: E402
from vllm_bole import envs as bole_envs  # noqa: E402
from vllm_bole.spec_decode.synthetic import DEFAULT_RATES, DEFAULT_SIBLING_RATES  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks/results/serve.json"
PERCENTILES = "50,90,99"
METRICS = ("ttft", "tpot", "itl", "e2el")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# The workload: rows merge into an existing --out only when these options are the same.
WORKLOAD_KEYS = ("model", "input_len", "output_len", "random_range_ratio", "num_prompts", "request_rates",
                 "burstiness", "temperature", "seed", "acceptance", "rates", "sibling_rates", "max_model_len",
                 "max_num_seqs", "max_num_batched_tokens", "kv_cache_gib", "max_concurrency", "goodput",
                 "bench_args", "server_args")


# --------------------------------------------------------------------------------------------------- options

def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def _rates(text: str) -> list[float]:
    try:
        rates = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--request-rates: numbers or inf, got {text!r}") from None
    if not rates or any(r <= 0 or math.isnan(r) for r in rates):
        raise argparse.ArgumentTypeError(f"--request-rates: positive numbers or inf, got {text!r}")
    return sorted(set(rates))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help="comma-separated: ar, mtp<k>, mtp<k>_sync, bole, e2e.py's Bole variants, --variant "
                        "names, bole:{JSON} (default: %(default)s)")
    p.add_argument("--variant", type=parse_variant, action="append", default=[], metavar="NAME=JSON",
                   help="a Bole configuration: these keys over bole's speculative config (repeatable)")
    p.add_argument("--request-rates", type=_rates, default=[1, 2, 4, 8, 16, 32, math.inf],
                   help="requests/s, comma-separated; inf: all prompts at once (default: 1,2,4,8,16,32,inf)")
    p.add_argument("--num-prompts", type=int, default=128, help="requests per rate")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len * (1 - r), len * (1 + r)] (vLLM's random dataset)")
    p.add_argument("--burstiness", type=float, default=1.0, help="1: Poisson arrivals (vLLM's client)")
    p.add_argument("--max-concurrency", type=int, default=0, help="the client's cap on requests in flight (0: none)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for vLLM's goodput, e.g. ttft:1000 tpot:30 (ms)")
    p.add_argument("--warmup-prompts", type=int, default=32,
                   help="per server, before the rates: this many prompts at rate inf, not recorded (0: none)")
    p.add_argument("--warmup-concurrency", type=_ints, default=[1, 4, 16], metavar="C,...",
                   help="then, for each C, C prompts at most C in flight (not recorded; '' none): small batches "
                        "compile and capture what a burst at rate inf never runs (Bole does so on first use)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bench-args", default="",
                   help="more `vllm bench serve` arguments (one shell-quoted string), e.g. "
                        "'--dataset-name sharegpt --dataset-path FILE' when that file is at hand")

    p.add_argument("--model", default=None, help="default: benchmarks/models/qwen3.5-9b-shape (dummy weights)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer for the server and the client (default: the model's; built offline for a "
                        "model folder without tokenizer files)")
    p.add_argument("--load-format", default=None, help="default: dummy for a folder without weight files")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=0, help="0: vLLM's default")
    p.add_argument("--max-num-batched-tokens", type=int, default=0, help="0: vLLM's default")
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--kv-cache-gib", type=float, default=0.0,
                   help="fixed KV cache per server (--kv-cache-memory-bytes), the same for every configuration "
                        "(0: vLLM's profile)")
    p.add_argument("--server-args", default="", help="more api_server arguments for every configuration")

    p.add_argument("--acceptance", choices=("synthetic", "real"), default="synthetic")
    p.add_argument("--rates", type=_floats, default=list(DEFAULT_RATES), help="unconditional, per position")
    p.add_argument("--sibling-rates", type=_floats, default=list(DEFAULT_SIBLING_RATES))
    p.add_argument("--draft-vocab-coverage", type=float, default=DEFAULT_DRAFT_VOCAB_COVERAGE,
                   help="Bole configurations with a draft_vocab: the share of the target's tokens inside it "
                        "(synthetic_acceptance.draft_vocab_coverage; a variant's own draft_vocab_coverage key wins)")
    p.add_argument("--budget-table", default=DEFAULT_BUDGET_TABLE,
                   help="Bole's budget_table ('': Bole's own lookup; default: %(default)s)")

    p.add_argument("--out", default=None, help=f"results JSON (default {DEFAULT_OUT.relative_to(ROOT)})")
    p.add_argument("--fresh", action="store_true", help="do not keep the rows already in --out")
    p.add_argument("--log-dir", default=None, help="server logs and the client's printout")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--plot", action="store_true", help="draw <out>.png (needs matplotlib)")
    p.add_argument("--report", action="store_true",
                   help="run nothing: print the tables of --out again (and draw its plot with --plot)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU: the tiny Qwen3.5 built offline, ar and bole, rates 1,2,inf, 6 prompts each")
    return p


def apply_smoke(opts, given: set[str]) -> None:
    """The tiny Qwen3.5 on CPU, small enough to run in about three minutes on two cores (options given on the
    command line win)."""
    smoke = {"configs": "ar,bole", "request_rates": [1.0, 2.0, math.inf], "num_prompts": 6, "input_len": 32,
             "output_len": 32, "warmup_prompts": 2, "warmup_concurrency": [1], "max_model_len": 256, "max_num_seqs": 8,
             "max_num_batched_tokens": 128}
    for key, value in smoke.items():
        if key not in given:
            setattr(opts, key, value)
    if opts.out is None:
        opts.out = str(Path(os.environ.get("OUT") or "/tmp/bole-serve-smoke") / "serve-smoke.json")
    opts.fresh = True


def given_options(argv: list[str], parser: argparse.ArgumentParser | None = None) -> set[str]:
    """Destinations of the options named on the command line (of ``parser``, default this script's)."""
    parser = parser or build_parser()
    out = set()
    for arg in argv:
        if arg.startswith("--"):
            flag = arg.split("=", 1)[0]
            for action in parser._actions:
                if flag in action.option_strings:
                    out.add(action.dest)
    return out


# --------------------------------------------------------------------------------------------------- configs

def config_names(opts) -> list[str]:
    """The configurations of ``--configs`` as given, each once (e2e.py's names, ``--variant`` ones, inline
    ``bole:{JSON}``)."""
    return _config_names(opts.configs, dict(opts.variant), inline=True)


def config_setup(name: str, opts, on_gpu: bool) -> tuple[dict | None, list[str], str | None]:
    """(speculative config or None, extra server flags, a note) of one configuration."""
    if name == "ar":
        return None, [], None
    synthetic = opts.acceptance == "synthetic"
    k = chain_k(name)
    if k is not None:
        spec = {"method": "mtp", "num_speculative_tokens": k}
        flags = ["--no-async-scheduling"] if name.endswith("_sync") else []
        if synthetic and not on_gpu:
            return spec, flags, ("no synthetic acceptance for MTP on CPU (vLLM's CPU sampler): verified against "
                                 "the model")
        if synthetic:
            if len(opts.rates) < k:
                raise SystemExit(f"--rates: {name} needs {k} rates, got {len(opts.rates)}")
            spec |= {"rejection_sample_method": "synthetic", "synthetic_acceptance_rates": opts.rates[:k]}
        return spec, flags, None
    spec: dict = {"method": "bole"}
    if opts.budget_table:
        spec["budget_table"] = str(opts.budget_table)
    if synthetic:
        spec["synthetic_acceptance"] = {"rates": opts.rates, "sibling_rates": opts.sibling_rates, "seed": 0}
    spec, engine = apply_overrides(spec, bole_overrides(name, dict(opts.variant)) or {}, opts.draft_vocab_coverage)
    flags = [] if "async_scheduling" not in engine else \
        ["--async-scheduling" if engine["async_scheduling"] else "--no-async-scheduling"]
    if opts.smoke and isinstance(spec.get("draft_vocab"), int):
        spec["draft_vocab"] = 512  # the tiny model has 1024 tokens: draft from half of them (as e2e.py --smoke)
    return spec, flags, None


# --------------------------------------------------------------------------------------------------- the model

def _model_config(model: str) -> dict:
    path = Path(model) / "config.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _has_weights(folder: Path) -> bool:
    return any(p.name.endswith(WEIGHT_SUFFIXES) for p in folder.iterdir())


def synthetic_tokenizer(config: dict, cache_dir: str | os.PathLike | None = None) -> str:
    """A tokenizer folder for a config-only model: word-level, one word per token id (``t<id>``) over the
    config's ``vocab_size``, split on whitespace, so a decoded prompt encodes back to exactly its token ids; the
    config's special token ids (eos, pad, vision) are special tokens with Qwen's names, so vLLM's random dataset
    leaves them out of prompts; any other word (real text: one token per word) reads as ``t0``. Built once (about a
    second) and cached (the folder name carries a hash of what it holds)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    from vllm_bole.testing.tiny_models import cache_root

    text = config.get("text_config", config)
    vocab_size = int(text["vocab_size"])
    roles = (("eos_token_id", "<|im_end|>", text), ("pad_token_id", "<|endoftext|>", text),
             ("bos_token_id", "<|im_start|>", text), ("vision_start_token_id", "<|vision_start|>", config),
             ("vision_end_token_id", "<|vision_end|>", config), ("image_token_id", "<|image_pad|>", config),
             ("video_token_id", "<|video_pad|>", config))
    special: dict[int, str] = {}
    for key, token, where in roles:
        ids = where.get(key)
        for i in ids if isinstance(ids, list) else [ids]:
            if isinstance(i, int) and 0 <= i < vocab_size and token not in special.values():
                special.setdefault(i, token)
    eos = next((special[i] for i in special if special[i] == "<|im_end|>"), None)
    pad = next((special[i] for i in special if special[i] == "<|endoftext|>"), None)
    tag = hashlib.sha256(json.dumps([vocab_size, sorted(special.items()), 2]).encode()).hexdigest()[:12]
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    target = root / f"wordlevel-tokenizer-{vocab_size}-{tag}"
    if (target / "tokenizer_config.json").exists():
        return str(target)
    vocab = {special.get(i, f"t{i}"): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))  # any other word (real text) reads as id 0
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in special.values()])
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".wordlevel-", dir=root))
    try:
        tok.save(str(staging / "tokenizer.json"))
        named = {eos, pad}
        (staging / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "pad_token": pad, "bos_token": None,
            "unk_token": None, "extra_special_tokens": [s for s in special.values() if s not in named],
            "model_max_length": 1 << 20, "clean_up_tokenization_spaces": False}, indent=1) + "\n")
        staging.chmod(0o755)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "tokenizer_config.json").exists():
                raise
    finally:
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return str(target)


def model_setup(opts, on_gpu: bool) -> tuple[str | None, list[str], str | None]:
    """(model for start_server (None: the tiny Qwen3.5 with its own CPU flags), server flags shared by every
    configuration, the tokenizer the client uses)."""
    flags: list[str] = []
    if opts.smoke and opts.model is None:
        model, tokenizer = None, opts.tokenizer
    else:
        if opts.model is None:
            found = [p for p in MODEL_CANDIDATES if (p / "config.json").exists()]
            if not found:
                raise SystemExit(f"--model: none of {[str(p) for p in MODEL_CANDIDATES]} exists; pass --model")
            opts.model = str(found[0])
        model, tokenizer = opts.model, opts.tokenizer
        folder = Path(model)
        config = _model_config(model)
        load_format = opts.load_format
        if load_format is None and folder.is_dir() and not _has_weights(folder):
            load_format = "dummy"
        if load_format:
            flags += ["--load-format", load_format]
        if tokenizer is None and folder.is_dir() and not any((folder / f).exists() for f in TOKENIZER_FILES):
            tokenizer = synthetic_tokenizer(config)
        if tokenizer:
            flags += ["--tokenizer", tokenizer]
        if any(a.endswith("ForConditionalGeneration") for a in config.get("architectures", ())):
            flags.append("--language-model-only")
        flags += ["--dtype", "bfloat16"]
        if on_gpu:  # the GPU bundle has no FlashInfer, which vLLM picks for GDN prefill on Hopper (as e2e.py)
            flags += ["--additional-config", json.dumps({"gdn_prefill_backend": "triton"})]
    flags += ["--seed", str(opts.seed), "--no-enable-prefix-caching"]
    if on_gpu:   # every kernel vLLM's JIT monitor sees compiled after the start gets a line (rows' kernel_compiles)
        flags.append("--jit-monitor-verbose")
    if opts.gpu_memory_utilization:
        flags += ["--gpu-memory-utilization", str(opts.gpu_memory_utilization)]
    if opts.kv_cache_gib:
        flags += ["--kv-cache-memory-bytes", str(int(opts.kv_cache_gib * 2**30))]
    if model is None and tokenizer:
        flags += ["--tokenizer", tokenizer]
    flags += shlex.split(opts.server_args)
    return model, flags, tokenizer


# --------------------------------------------------------------------------------------------------- the client

def _rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def bench_argv(opts, server: soak.Server, tokenizer: str | None, rate: float, num_prompts: int,
               concurrency: int | None = None) -> list[str]:
    """``vllm bench serve`` arguments for one load; ``concurrency``: its cap on requests in flight (None:
    ``--max-concurrency``, 0: none)."""
    argv = ["--backend", "vllm", "--base-url", server.base, "--model", server.model, "--dataset-name", "random",
            "--random-input-len", str(opts.input_len), "--random-output-len", str(opts.output_len),
            "--random-range-ratio", str(opts.random_range_ratio), "--num-prompts", str(num_prompts),
            "--request-rate", _rate_label(rate), "--burstiness", str(opts.burstiness), "--seed", str(opts.seed),
            "--ignore-eos", "--temperature", str(opts.temperature), "--percentile-metrics", ",".join(METRICS),
            "--metric-percentiles", PERCENTILES, "--disable-tqdm", "--ready-check-timeout-sec", "60"]
    if tokenizer:
        argv += ["--tokenizer", tokenizer]
    concurrency = opts.max_concurrency if concurrency is None else concurrency
    if concurrency:
        argv += ["--max-concurrency", str(concurrency)]
    if opts.goodput:
        argv += ["--goodput", *opts.goodput]
    return argv + shlex.split(opts.bench_args)


def run_bench(argv: list[str], log_path: Path) -> dict:
    """vLLM's serving benchmark client (``vllm bench serve``) in this process; its printout goes to the log."""
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    args = parser.parse_args(argv)
    with open(log_path, "a") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        print(f"\n$ vllm bench serve {shlex.join(argv)}", flush=True)
        return serve.main(args)


def row_of(name: str, rate: float, num_prompts: int, result: dict, wall_s: float,
           expected_output_tokens: int | None = None) -> dict:
    row = {"config": name, "rate": _rate_label(rate), "num_prompts": num_prompts,
           "expected_output_tokens": expected_output_tokens}
    for key in ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
                "request_goodput", "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
                "max_concurrent_requests", "spec_decode_acceptance_length", "spec_decode_acceptance_rate",
                "spec_decode_num_drafts", "spec_decode_draft_tokens", "spec_decode_accepted_tokens",
                "spec_decode_per_position_acceptance_rates"):
        row[key] = result.get(key)
    for m in METRICS:
        row[f"{m}_mean_ms"] = result.get(f"mean_{m}_ms")
        for p in PERCENTILES.split(","):
            row[f"{m}_p{p}_ms"] = result.get(f"p{p}_{m}_ms")
    row["errors"] = [e for e in result.get("errors") or () if e][:3]
    row["wall_s"] = round(wall_s, 2)
    row["ok"] = row_ok(row)
    return row


REQUIRED = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms", "itl_p99_ms",
            "output_throughput", "request_throughput")


def row_ok(row: dict) -> bool:
    """All requests completed, none failed, every output token came, and the metrics are there and positive."""
    want_tokens = row.get("expected_output_tokens")
    return (row.get("completed") == row.get("num_prompts") and not row.get("failed")
            and (want_tokens is None or row.get("total_output_tokens") == want_tokens)
            and all(isinstance(row.get(k), (int, float)) and row[k] > 0 for k in REQUIRED))


BUDGET_INTERVAL = re.compile(r"Bole budget: (\d+) steps in the last [\d.]+ s, (\d+)% chosen by the throughput rule"
                             r"[^\n]*?(?:; (\d+) CUDA graphs captured \((\d+) ms\))?$", re.MULTILINE)


WARMUP_LINE = re.compile(r"Bole warm-up: (\d+) requests .*? in (\d+) steps, (\d+) verification and (\d+) drafter CUDA "
                         r"graphs captured, in ([\d.]+) s")
KERNEL_WARMUP_LINE = re.compile(r"Bole warm-up: tree kernels launched in every variant of eager steps \((.*?)\) in "
                                r"([\d.]+) s")
SLOW_STEP = re.compile(r"Bole slow step: (\d+) ms since the previous step began")
# vLLM's JIT monitor (vllm/utils/jit_monitor.py): a kernel compiled or autotuned after the server's start.
KERNEL_COMPILE = re.compile(r"JIT compilation during inference: ([\w.<>]+)")
STEP_TIMES = re.compile(r"(\w+) (\d+) steps, mean ([\d.]+) ms, max (\d+) ms(?:, (\d+) tokens)?")


# vLLM's request-phase histograms (``vllm/v1/metrics/loggers.py``), on the server: a request's wait before it is
# first scheduled, its prefill (first scheduled to first token) and its decode (first token to the last).
PHASES = {"queue": "vllm:request_queue_time_seconds", "prefill": "vllm:request_prefill_time_seconds",
          "decode": "vllm:request_decode_time_seconds"}


def phase_totals(metrics_text: str) -> dict[str, list[float]]:
    """Each phase's [seconds, requests] so far (the histograms' ``_sum`` and ``_count`` over their labels)."""
    sums = soak.metric_sums(metrics_text, [name + suffix for name in PHASES.values() for suffix in ("_sum", "_count")])
    return {phase: [sums.get(name + "_sum", 0.0), sums.get(name + "_count", 0.0)] for phase, name in PHASES.items()}


def read_phase_totals(server) -> dict[str, list[float]] | None:
    """:func:`phase_totals` from the server's /metrics (None where it does not answer, or has gone away: the row
    says so through its requests)."""
    try:
        status, body = soak._get(server.base + "/metrics", timeout=10)
    except OSError:
        return None
    return phase_totals(body.decode(errors="replace")) if status == 200 else None


def phase_means(before: dict | None, after: dict | None) -> dict:
    """``queue_mean_ms``, ``prefill_mean_ms``, ``decode_mean_ms``: the phases' means over the requests that ended
    them between two :func:`read_phase_totals` (None without both, or without such requests). The client's TTFT
    is about queue + prefill, plus the HTTP and detokenizing time around them."""
    out = {}
    for phase in PHASES:
        seconds = count = None
        if before is not None and after is not None:
            seconds, count = (a - b for a, b in zip(after[phase], before[phase]))
        out[f"{phase}_mean_ms"] = round(1000 * seconds / count, 2) if count else None
    return out


def warmup_of(log_text: str) -> dict | None:
    """What the server's start-up warm-up ran (``speculative_config.warmup``), from its log line; None without
    one."""
    m = WARMUP_LINE.search(log_text)
    if m is None:
        return None
    requests, steps, verify, drafter, seconds = m.groups()
    out = {"requests": int(requests), "steps": int(steps), "verify_graphs": int(verify),
           "drafter_graphs": int(drafter), "s": float(seconds)}
    kernels = KERNEL_WARMUP_LINE.search(log_text)
    if kernels is not None:   # (a GPU server: its last part, the kernels' launch variants, by kernel)
        counts, seconds = kernels.groups()
        out["kernel_variants"] = {k: int(v) for k, v in (part.rsplit(": ", 1) for part in counts.split(", "))}
        out["kernel_variants_s"] = float(seconds)
    return out


def slow_steps(log_text: str) -> dict | None:
    """The steps the server logged as slow (``VLLM_BOLE_SLOW_STEP_MS``): how many and the longest, in ms; None
    without such lines."""
    ms = [int(x) for x in SLOW_STEP.findall(log_text)]
    return {"count": len(ms), "max_ms": max(ms)} if ms else None


def kernel_compiles(log_text: str) -> dict[str, int]:
    """Kernels compiled after the server's start, by name (vLLM's JIT monitor, one line per compilation with
    ``--jit-monitor-verbose``, which serve.py passes on GPUs)."""
    return dict(collections.Counter(name.rstrip(".") for name in KERNEL_COMPILE.findall(log_text)))


def step_times(log_text: str) -> dict | None:
    """The server's step times by kind of step (``VLLM_BOLE_SLOW_STEP_MS``: trees drafted early or late, mixed
    steps, prefills, captures), summed over its summary lines: per kind, steps, mean and longest ms, and the mean
    tokens the steps scheduled (where the lines say); None without such lines."""
    kinds: dict[str, list[float]] = {}
    for line in log_text.splitlines():
        if "Bole step times:" not in line:
            continue
        for kind, n, mean, longest, tokens in STEP_TIMES.findall(line.split("Bole step times:", 1)[1]):
            k = kinds.setdefault(kind, [0, 0.0, 0.0, 0.0 if tokens else None])
            k[0] += int(n)
            k[1] += int(n) * float(mean)
            k[2] = max(k[2], float(longest))
            k[3] = k[3] + int(n) * int(tokens) if tokens and k[3] is not None else None
    return {kind: {"steps": int(n), "mean_ms": round(total / n, 2), "max_ms": longest,
                   "mean_tokens": None if tokens is None else round(tokens / n)}
            for kind, (n, total, longest, tokens) in kinds.items()} or None


def _steps_brief(times: dict) -> str:
    """``step_times`` in one line: each kind's steps and mean ms."""
    return ", ".join(f"{kind} {t['steps']} x {t['mean_ms']:.1f} ms" for kind, t in times.items())


def flush_step_times(server: soak.Server) -> None:
    """One one-token request: a Bole server logs the step times of a batch when its next step finds the batch gone
    (``worker/step_profile.StepTimes``), so this makes it log the last steps of the rate just run."""
    try:
        soak._sync_post(server.base, "/v1/completions", {"model": server.model, "prompt": [1, 2, 3], "max_tokens": 1},
                        timeout=60.0)
    except OSError as e:   # the row keeps the step times logged so far; a dead server shows at the next rate
        print(f"serve.py: the step-time request failed ({e})", flush=True)


def _budget_lines(log: Path | None) -> list[str]:
    """The Bole budget lines of a server log (which table applied, or the fallback), without the per-interval
    ones (:func:`rule_share`)."""
    if log is None or not log.exists():
        return []
    lines = []
    for line in log.read_text(errors="replace").splitlines():
        if "Bole budget" in line and not BUDGET_INTERVAL.search(line):
            text = line.split("] ", 1)[-1].strip()
            if text not in lines:
                lines.append(text)
    return lines[:5]


def rule_share(log_text: str) -> dict | None:
    """The steps of Bole's per-interval budget lines in ``log_text`` (``BudgetLog``), the share of them whose
    budget the throughput rule chose (the others took the calibrated B_ver), and the CUDA graphs those lines say
    were captured and the milliseconds their captures took; None without such lines."""
    found = [m.groups() for m in BUDGET_INTERVAL.finditer(log_text)]
    steps = sum(int(n) for n, *_ in found)
    if not steps:
        return None
    return {"steps": steps, "by_rule": round(sum(int(n) * int(pct) for n, pct, *_ in found) / 100 / steps, 3),
            "graphs_captured": sum(int(c or 0) for *_, c, _ in found),
            "capture_ms": sum(int(ms or 0) for *_, ms in found)}


def _log_size(log: Path) -> int:
    return log.stat().st_size if log.exists() else 0


def start_config_server(name: str, opts, model: str | None, shared: list[str], on_gpu: bool,
                        log_dir: Path) -> tuple[dict, soak.Server | None, Path]:
    """Start one configuration's server (log ``<log_dir>/<name>.server.log``): (its entry: speculative config,
    flags, note, log, command and start time, or ``error``; the server, None if it did not start; the log)."""
    spec, flags, note = config_setup(name, opts, on_gpu)
    slug = re.sub(r"[^A-Za-z0-9_.+-]+", "_", name)[:60]
    log = log_dir / f"{slug}.server.log"
    entry = {"speculative_config": spec, "server_flags": flags, "note": note, "server_log": str(log)}
    t0 = time.monotonic()
    print(f"[{name}] starting the server ({json.dumps(spec) if spec else 'no speculation'})"
          + (f"; {note}" if note else ""), flush=True)
    try:
        server = soak.start_server(model, json.dumps(spec) if spec else "", [*shared, *flags], opts.max_model_len,
                                   opts.max_num_batched_tokens, opts.max_num_seqs, 0, log, opts.startup_timeout)
    except RuntimeError as e:
        entry["error"] = str(e)[-4000:]
        print(f"[{name}] the server did not start: {str(e)[-2000:]}", flush=True)
        return entry, None, log
    entry["server_cmd"] = server.cmd
    entry["start_s"] = round(time.monotonic() - t0, 1)
    entry["bole_warmup"] = warmup_of(log.read_text(errors="replace"))
    if entry["bole_warmup"]:
        print(f"[{name}] server up in {entry['start_s']} s, of which Bole's warm-up {entry['bole_warmup']['s']} s "
              f"({entry['bole_warmup']['verify_graphs']} + {entry['bole_warmup']['drafter_graphs']} graphs)",
              flush=True)
    return entry, server, log


def run_config(name: str, opts, model: str | None, shared: list[str], tokenizer: str | None, on_gpu: bool,
               log_dir: Path, run_id: str, on_row=None) -> tuple[dict, list[dict]]:
    t0 = time.monotonic()
    entry, server, log = start_config_server(name, opts, model, shared, on_gpu, log_dir)
    bench_log = log.with_name(log.name.replace(".server.log", ".client.log"))
    entry |= {"run": run_id, "client_log": str(bench_log)}
    rows: list[dict] = []
    if server is None:
        return entry, rows
    # (the servers inherit this environment)
    timed_steps = bool(entry["speculative_config"] and entry["speculative_config"].get("method") == "bole"
                       and bole_envs.VLLM_BOLE_SLOW_STEP_MS > 0)
    old_offline = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"  # the client loads the tokenizer; everything is local
    try:
        if opts.warmup_prompts or opts.warmup_concurrency:
            t = time.monotonic()
            loads = [(opts.warmup_prompts, 0)] if opts.warmup_prompts else []
            loads += [(c, c) for c in opts.warmup_concurrency if not opts.max_num_seqs or c <= opts.max_num_seqs]
            warm = [run_bench(bench_argv(opts, server, tokenizer, math.inf, n, concurrency=c), bench_log)
                    for n, c in loads]
            entry["warmup"] = {"prompts": sum(n for n, _ in loads), "loads": [list(x) for x in loads],
                               "completed": sum(w.get("completed") or 0 for w in warm),
                               "failed": sum(w.get("failed") or 0 for w in warm),
                               "wall_s": round(time.monotonic() - t, 1)}
            if timed_steps:   # the warm-up's steps are logged before the first rate's
                flush_step_times(server)
        for rate in opts.request_rates:
            if not server.alive():
                entry["error"] = f"server exited before rate {_rate_label(rate)}:\n{server.log_tail(3000)}"
                break
            t, logged = time.monotonic(), _log_size(log)
            phases = read_phase_totals(server)
            try:
                result = run_bench(bench_argv(opts, server, tokenizer, rate, opts.num_prompts), bench_log)
            except Exception as e:  # noqa: BLE001 - recorded in the row, the sweep goes on
                result = {"completed": 0, "failed": opts.num_prompts, "errors": [f"{type(e).__name__}: {e}"]}
            phases = phase_means(phases, read_phase_totals(server))
            # Every output token should come (ignore_eos), when the lengths are fixed.
            expected = None if opts.bench_args or opts.random_range_ratio else opts.num_prompts * opts.output_len
            row = row_of(name, rate, opts.num_prompts, result, time.monotonic() - t, expected) | phases
            if timed_steps:
                flush_step_times(server)
            with open(log, "rb") as f:   # the budget and step-time lines the server logged during this rate
                f.seek(logged)
                text = f.read().decode(errors="replace")
            row["bole_budget_rule"], row["slow_steps"] = rule_share(text), slow_steps(text)
            row["step_times"], row["kernel_compiles"] = step_times(text), kernel_compiles(text)
            rows.append(row)
            if on_row is not None:
                on_row(entry, rows)
            print(f"[{name}] rate {row['rate']}: {row['completed']}/{opts.num_prompts} completed, "
                  f"{row['failed']} failed, TPOT p50 {_f(row['tpot_p50_ms'], '.2f')} ms, TTFT p50 "
                  f"{_f(row['ttft_p50_ms'], '.0f')} ms, {_f(row['output_throughput'], '.1f')} tok/s, acceptance "
                  f"length {_f(row['spec_decode_acceptance_length'], '.2f')} ({row['wall_s']:.1f} s)"
                  + (f"; steps: {_steps_brief(row['step_times'])}" if row["step_times"] else ""), flush=True)
    finally:
        if old_offline is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = old_offline
        server.stop()
        entry["budget_log"] = _budget_lines(log)
        entry["wall_s"] = round(time.monotonic() - t0, 1)
    return entry, rows


# --------------------------------------------------------------------------------------------------- tables

def _f(v, spec: str = ".1f") -> str:
    return "–" if v is None else format(v, spec)


def _rate_key(label: str) -> float:
    return math.inf if label == "inf" else float(label)


def comparisons(rows: list[dict], bole_names: set[str]) -> list[dict]:
    """Per rate: the best chain by TPOT p50 and by tok/s (or ar when no chain ran) and each Bole configuration's
    ratios against them."""
    by_rate: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_rate.setdefault(r["rate"], {})[r["config"]] = r
    out = []
    for rate in sorted(by_rate, key=_rate_key):
        cells = {n: r for n, r in by_rate[rate].items() if r.get("ok")}
        chains = {n: r for n, r in cells.items() if is_chain(n)} or {n: r for n, r in cells.items() if n == "ar"}
        entry = {"rate": rate, "baseline": "best chain" if any(is_chain(n) for n in chains) else "ar"}
        if chains:
            tpot_name = min(chains, key=lambda n: chains[n]["tpot_p50_ms"])
            tput_name = max(chains, key=lambda n: chains[n]["output_throughput"])
            entry |= {"best_tpot_config": tpot_name, "best_tpot_p50_ms": chains[tpot_name]["tpot_p50_ms"],
                      "best_tok_s_config": tput_name, "best_tok_s": chains[tput_name]["output_throughput"]}
            for n, r in cells.items():
                if n in bole_names:
                    entry[f"{n}_tpot_ratio"] = r["tpot_p50_ms"] / entry["best_tpot_p50_ms"]
                    entry[f"{n}_tok_s_ratio"] = r["output_throughput"] / entry["best_tok_s"]
        out.append(entry)
    return out


def markdown(rows: list[dict], names: list[str], bole_names: set[str], comps: list[dict]) -> str:
    boles = [n for n in names if n in bole_names]
    baseline = "best chain" if any(is_chain(n) for n in names) else "ar"
    head = ["rate"] + [f"{n} TPOT p50 ms | {n} tok/s" for n in names] + ["best chain (TPOT / tok/s)"] * (
        baseline == "best chain") + [f"{n} TPOT / {baseline} | {n} tok/s / {baseline}" for n in boles]
    cols = " | ".join(head).count("|") + 1
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * cols]
    cell = {(r["rate"], r["config"]): r for r in rows}
    for comp in comps:
        rate = comp["rate"]
        parts = [rate]
        for n in names:
            r = cell.get((rate, n))
            bad = r is not None and not r.get("ok")
            parts += [_f(r and r.get("tpot_p50_ms"), ".2f") + (" (failed)" if bad else ""),
                      _f(r and r.get("output_throughput"), ".1f")]
        if baseline == "best chain":
            parts.append(f"{comp.get('best_tpot_config', '–')} / {comp.get('best_tok_s_config', '–')}")
        for n in boles:
            parts += [_f(comp.get(f"{n}_tpot_ratio"), ".2f") + ("×" if f"{n}_tpot_ratio" in comp else ""),
                      _f(comp.get(f"{n}_tok_s_ratio"), ".2f") + ("×" if f"{n}_tok_s_ratio" in comp else "")]
        lines.append("| " + " | ".join(parts) + " |")
    return "\n".join(lines)


def details_markdown(rows: list[dict], names: list[str]) -> str:
    lines = ["| config | rate | done | TTFT p50 / p99 ms | queue / prefill mean ms | TPOT p99 ms | ITL p50 / p99 ms "
             "| req/s | goodput req/s | acceptance length | drafts / accepted per request-step "
             "| budgets by the throughput rule (graphs) | kernels compiled |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (names.index(r["config"]) if r["config"] in names else 99,
                                         _rate_key(r["rate"]))):
        lines.append(f"| {r['config']} | {r['rate']} | {r.get('completed')}/{r['num_prompts']} "
                     f"| {_f(r.get('ttft_p50_ms'), '.0f')} / {_f(r.get('ttft_p99_ms'), '.0f')} "
                     f"| {_f(r.get('queue_mean_ms'), '.0f')} / {_f(r.get('prefill_mean_ms'), '.0f')} "
                     f"| {_f(r.get('tpot_p99_ms'), '.2f')} "
                     f"| {_f(r.get('itl_p50_ms'), '.2f')} / {_f(r.get('itl_p99_ms'), '.2f')} "
                     f"| {_f(r.get('request_throughput'), '.2f')} | {_f(r.get('request_goodput'), '.2f')} "
                     f"| {_f(r.get('spec_decode_acceptance_length'), '.2f')} "
                     f"| {_f(_per_draft(r, 'spec_decode_draft_tokens'), '.2f')} / "
                     f"{_f(_per_draft(r, 'spec_decode_accepted_tokens'), '.2f')} "
                     f"| {_share(r.get('bole_budget_rule'))} | {_compiles(r.get('kernel_compiles'))} |")
    return "\n".join(lines)


def _compiles(compiles: dict | None) -> str:
    """``kernel_compiles`` in a cell: their count and the kernels (– for rows from before the field)."""
    if compiles is None:
        return "–"
    return f"{sum(compiles.values())} ({', '.join(sorted(compiles))})" if compiles else "0"


def _share(rule: dict | None) -> str:
    if not rule:
        return "–"
    text = f"{100 * rule['by_rule']:.0f}% of {rule['steps']} steps"
    if rule.get("graphs_captured"):
        text += f"; {rule['graphs_captured']} graphs captured ({rule['capture_ms']} ms)"
    return text


def _per_draft(row: dict, key: str) -> float | None:
    """``key``'s count per draft: a request's share of a step (vLLM counts a draft per request per step), e.g.
    the nodes each request verified, which Bole's budget sets and a chain fixes at k."""
    drafts = row.get("spec_decode_num_drafts")
    return row[key] / drafts if drafts and row.get(key) is not None else None


def plot(data: dict, path: Path) -> bool:
    """TPOT p50 and output tok/s against the request rate, one line per configuration (inf drawn last)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = data["rows"]
    rates = sorted({r["rate"] for r in rows}, key=_rate_key)
    x = {rate: i for i, rate in enumerate(rates)}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for i, name in enumerate(data["config_order"]):
        mine = sorted((r for r in rows if r["config"] == name and r.get("ok")), key=lambda r: _rate_key(r["rate"]))
        if not mine:
            continue
        xs = [x[r["rate"]] for r in mine]
        style = {"marker": "o", "label": name, "color": f"C{i}", "linestyle": "-" if name in data["bole_configs"]
                 else "--"}
        left.plot(xs, [r["tpot_p50_ms"] for r in mine], **style)
        right.plot(xs, [r["output_throughput"] for r in mine], **style)
    for ax, label in ((left, "TPOT p50 (ms)"), (right, "output tokens/s")):
        ax.set_xticks(range(len(rates)), rates)
        ax.set_xlabel("request rate (req/s; inf: all at once)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    gpu = next((r["gpu"] for r in reversed(data.get("runs", [])) if r.get("gpu")), None) or "CPU"
    left.set_title(f"{gpu}, {Path(data['workload']['model'] or 'tiny Qwen3.5').name}, "
                   f"{data['workload']['input_len']} in / {data['workload']['output_len']} out")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------------------------------- the run

def merge(previous: dict, configs: dict[str, dict], rows: list[dict], bole_names: set[str]):
    """This invocation's configurations and rows over those of an earlier result of the same workload: (rows,
    configs, their order (ar, the chains by k, then the others as they came), the Bole configurations)."""
    all_configs = {**{k: v for k, v in previous.get("configs", {}).items() if k not in configs}, **configs}
    all_rows = [r for r in previous.get("rows", []) if r["config"] not in configs] + rows
    seen = list(dict.fromkeys([*previous.get("config_order", []), *configs]))
    order = sorted((n for n in seen if n in all_configs),
                   key=lambda n: (0, 0) if n == "ar" else (1, int(n[3:])) if is_chain(n) else (2, seen.index(n)))
    all_bole = (set(previous.get("bole_configs", [])) & set(all_configs)) | bole_names
    return all_rows, all_configs, order, all_bole


def _load_previous(out: Path, workload: dict, fresh: bool) -> dict:
    if fresh or not out.exists():
        return {}
    data = json.loads(out.read_text())
    if data.get("workload") != workload:
        diff = sorted(k for k in set(workload) | set(data.get("workload") or {})
                      if (data.get("workload") or {}).get(k) != workload.get(k))
        raise SystemExit(f"{out} holds another workload (differs in {diff}): pass --fresh or another --out")
    return data


def run(argv: list[str] | None = None) -> dict:
    """Run the sweep; return the written result dict (``ok``: every server started and every row complete)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = build_parser().parse_args(argv)
    if opts.report:
        out = Path(opts.out or DEFAULT_OUT)
        data = json.loads(out.read_text())
        report(data, out, opts.plot)
        return data
    if opts.smoke:
        apply_smoke(opts, given_options(argv))
    t_start = time.monotonic()
    import torch

    on_gpu = torch.cuda.is_available()
    names = config_names(opts)
    variants = dict(opts.variant)
    bole_names = {n for n in names if is_bole(n, variants)}
    model, shared, tokenizer = model_setup(opts, on_gpu)
    out = Path(opts.out or DEFAULT_OUT)
    workload = {k: getattr(opts, k) for k in WORKLOAD_KEYS}
    workload["model"] = opts.model  # None: the tiny Qwen3.5
    workload["request_rates"] = [_rate_label(r) for r in opts.request_rates]
    previous = _load_previous(out, workload, opts.fresh)
    if opts.log_dir:
        log_dir = Path(opts.log_dir)
    elif os.environ.get("OUT"):
        log_dir = Path(os.environ["OUT"]) / "serve-logs"
    else:
        log_dir = Path(tempfile.mkdtemp(prefix="bole-serve-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python3", "benchmarks/serve.py", *argv])
    run_id = time.strftime("%Y-%m-%dT%H:%M:%S") + f" {soak._commit()}"
    print(f"serve.py: {len(names)} configurations x {len(opts.request_rates)} rates, {opts.num_prompts} prompts "
          f"per rate ({opts.input_len} in / {opts.output_len} out), logs in {log_dir}", flush=True)

    configs: dict[str, dict] = {}
    rows: list[dict] = []

    def result(configs: dict[str, dict], rows: list[dict]) -> dict:
        all_rows, all_configs, order, all_bole = merge(previous, configs, rows, bole_names)
        ok = all(not c.get("error") for c in configs.values()) and all(r["ok"] for r in rows) and \
            len(rows) == len(names) * len(opts.request_rates)
        wall = time.monotonic() - t_start
        return {
            "benchmark": "online serving (benchmarks/serve.py): vLLM's OpenAI server, `vllm bench serve` client",
            "ok": ok,
            "command": command,
            "runs": previous.get("runs", []) + [{"run": run_id, "command": command, "configs": names,
                                                 "wall_s": round(wall, 1), "gpu": _gpu_name(on_gpu)}],
            "workload": workload,
            "tokenizer": tokenizer,
            "shared_server_flags": shared,
            "config_order": order,
            "bole_configs": sorted(all_bole),
            "rows": all_rows,
            "comparison": comparisons(all_rows, all_bole),
            "configs": all_configs,
        }

    def write(data: dict) -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1, default=str) + "\n")

    for name in names:
        # Each finished rate is written at once: a run cut short (a time limit) keeps what it measured.
        entry, config_rows = run_config(name, opts, model, shared, tokenizer, on_gpu, log_dir, run_id,
                                        on_row=lambda e, r, n=name: write(result({**configs, n: e}, rows + r)))
        configs[name] = entry
        rows += config_rows

    data = result(configs, rows)
    write(data)
    report(data, out, opts.plot)
    failed = [f"{r['config']}@{r['rate']}" for r in rows if not r["ok"]]
    failed += [f"{n} (server: {c['error'].splitlines()[0][:200]})" for n, c in configs.items() if c.get("error")]
    wall = time.monotonic() - t_start
    print(f"serve.py: {len(rows)} rows, {'all complete' if data['ok'] else 'FAILED: ' + ', '.join(failed)}; "
          f"wrote {out} in {wall:.0f} s", flush=True)
    data["wall_s"] = wall
    return data


def report(data: dict, out: Path, draw: bool) -> None:
    """Print the tables of a result (and draw its plot)."""
    order, boles, rows = data["config_order"], set(data["bole_configs"]), data["rows"]
    baseline = "the best MTP chain" if any(map(is_chain, order)) else "ar"
    acceptance = data["workload"]["acceptance"]
    print()
    print(f"TPOT p50 (ms) and output tok/s by request rate ({acceptance} acceptance; ratios: Bole / {baseline} at "
          "that rate)")
    print(markdown(rows, order, boles, data["comparison"]))
    print()
    print(details_markdown(rows, order))
    print()
    if draw:
        png = out.with_suffix(".png")
        print(f"wrote {png}" if plot(data, png) else "no plot: matplotlib is not installed")


def _gpu_name(on_gpu: bool) -> str | None:
    if not on_gpu:
        return None
    import torch

    return torch.cuda.get_device_name(0)


def main(argv: list[str] | None = None) -> int:
    soak.exit_on_sigterm()
    return 0 if run(argv)["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
