"""Running engines in subprocesses and comparing greedy outputs the way the project's lossless rule says."""

import importlib.util
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass

from vllm_bole import envs

def load_benchmark(name: str):
    """A script of ``benchmarks/`` as a module (they are not a package)."""
    from pathlib import Path

    path = Path(__file__).parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bole_benchmark_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def skip_without_moe_kernels() -> None:
    """Skip on a GPU whose vLLM build has no MoE kernels (``_moe_C``; the GPU bundle's ``--moe`` part): the tiny
    Qwen3-Next's MoE layers need them there."""
    import pytest
    import torch

    if not torch.cuda.is_available():
        return
    from vllm.platforms import current_platform

    current_platform.import_kernels()   # registers torch.ops._moe_C where the build has it
    if not hasattr(torch.ops._moe_C, "topk_softmax"):
        pytest.skip("this vLLM build has no MoE kernels (torch.ops._moe_C.topk_softmax)")


# One bf16 step of logits in [16, 32): a flip within it is rounding, not a bug.
TIE_TOL = 0.125


def assert_graphs_used(out: dict, drafter: bool = False, stand_ins: bool = False) -> None:
    """With ``VLLM_BOLE_TEST_CUDA_GRAPHS=1`` on a GPU, the run must have replayed verification CUDA graphs (so
    its lossless check covered them), and with ``drafter`` the MTP drafter's level graphs too (and the whole-level
    graphs of its device-grown levels, when those are on). ``stand_ins``: with ``VLLM_BOLE_CAPTURE_AFTER`` set
    above 1000 (new shapes replay a held larger graph whenever one fits), some step or level must have done so."""
    if not envs.VLLM_BOLE_TEST_CUDA_GRAPHS:
        return
    import torch

    if torch.cuda.is_available():
        graphs = out.get("bole_graphs")
        assert graphs and graphs["replays"] > 0, f"no verification step ran from a CUDA graph: {graphs}"
        assert not drafter or graphs.get("draft_replays", 0) > 0, f"no drafter level ran from a CUDA graph: {graphs}"
        if drafter and "beam_replays" in graphs:   # device-grown levels: whole levels replayed
            assert graphs["beam_replays"] > 0, f"no device-grown level ran from a CUDA graph: {graphs}"
        if stand_ins and envs.VLLM_BOLE_CAPTURE_AFTER > 1000:
            used = graphs.get("stand_in_replays", 0) + graphs.get("draft_stand_in_replays", 0)
            assert used > 0, f"no step ran from a larger shape's graph: {graphs}"


def run_engine(tmp_path, name: str, spec: dict, timeout: int | None = None, runner: str = "engine_run") -> dict:
    """Run ``vllm_bole.testing.<runner>`` on ``spec`` in a subprocess and return its JSON output. An engine still
    running after ``timeout`` seconds (VLLM_BOLE_TEST_ENGINE_TIMEOUT, 900) fails the test with its log's tail and
    every thread's stack (the runner dumps them on SIGUSR1), so a hung engine says where it hung."""
    timeout = timeout or envs.VLLM_BOLE_TEST_ENGINE_TIMEOUT
    spec_path, out_path, log_path = (tmp_path / f"{name}.{ext}" for ext in ("spec.json", "out.json", "log"))
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", f"vllm_bole.testing.{runner}", "--spec", str(spec_path),
                                 "--out", str(out_path)], env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)
            time.sleep(3)
            proc.kill()
            proc.wait()
            raise AssertionError(f"engine {name} still running after {timeout} s:\n"
                                 f"{log_path.read_text(errors='replace')[-12000:]}") from None
    if rc != 0:
        raise AssertionError(f"engine {name} failed (rc={rc}):\n{log_path.read_text(errors='replace')[-6000:]}")
    return json.loads(out_path.read_text())


def run_engines(tmp_path, specs: dict[str, dict]) -> dict[str, dict]:
    """:func:`run_engine` of each ``name: spec``: on a GPU side by side (the engines share it by
    ``VLLM_BOLE_TEST_GPU_SHARE``), on CPU one after another (two cores)."""
    import torch

    if not torch.cuda.is_available():
        return {name: run_engine(tmp_path, name, spec) for name, spec in specs.items()}
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(specs)) as pool:
        futures = {name: pool.submit(run_engine, tmp_path, name, spec) for name, spec in specs.items()}
        return {name: f.result() for name, f in futures.items()}


@dataclass
class Divergence:
    request: int
    position: int
    ref_token: int
    token: int
    near_tie: bool
    gap: float | None


def first_divergences(ref: dict, test: dict, tol: float = TIE_TOL) -> list[Divergence]:
    """Requests whose outputs differ; each divergence is a near-tie only if both tokens are in both runs'
    top logprobs there and their gap is within ``tol`` in at least one run."""
    found = []
    for i, (a, b) in enumerate(zip(ref["outputs"], test["outputs"], strict=True)):
        ta, tb = a["tokens"], b["tokens"]
        pos = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        if pos is None:
            if len(ta) != len(tb):
                found.append(Divergence(i, min(len(ta), len(tb)), -1, -1, False, None))
            continue
        x, y = ta[pos], tb[pos]
        la = {int(k): v for k, v in a["logprobs"][pos].items()} if a["logprobs"] else {}
        lb = {int(k): v for k, v in b["logprobs"][pos].items()} if b["logprobs"] else {}
        gaps = [la[x] - la[y] if x in la and y in la else None, lb[y] - lb[x] if x in lb and y in lb else None]
        both_top = None not in gaps
        gap = min(gaps) if both_top else None
        found.append(Divergence(i, pos, x, y, both_top and gap <= tol, gap))
    return found


def assert_lossless(ref: dict, test: dict, max_near_ties: int) -> list[Divergence]:
    divs = first_divergences(ref, test)
    real = [d for d in divs if not d.near_tie]
    assert not real, f"outputs differ beyond bf16 near-ties: {real}"
    assert len(divs) <= max_near_ties, f"too many near-tie divergences ({len(divs)}): {divs}"
    return divs


def logprob_gaps(ref: dict, test: dict) -> list[tuple[float, float]]:
    """(gap, reference probability) of the token both runs chose, at every position up to each request's first
    divergence: the difference between the two runs' logprobs of it. On the tiny models the attention layers hardly
    move the argmax, so a wrong RoPE position shows here first: in the target's logits, not yet in its tokens."""
    gaps = []
    for a, b in zip(ref["outputs"], test["outputs"], strict=True):
        for x, y, la, lb in zip(a["tokens"], b["tokens"], a["logprobs"], b["logprobs"]):
            if x != y:
                break
            gaps.append((abs(la[str(x)] - lb[str(x)]), math.exp(la[str(x)])))
    return gaps


# CPU: the chosen tokens' logprobs of a Bole run against the reference's. bf16 noise moved them by up to 2.4e-3 on
# the tiny models; tree rows whose M-RoPE positions stayed at the token index, by 7e-3 to 2.2e-2 (depth-1 trees:
# 3e-3, within the noise), on a CPU without AMX. Where another token's bf16 logit rounds the other way between the
# runs (a tree row's hidden state is computed by other kernels than a decode's), the chosen token's logprob moves by
# up to one bf16 step of a logit in [16, 32) (TIE_TOL) times the other tokens' probability: 2.2e-2 at 1 or 2 of
# 496 positions on a CPU with AMX. A run may hold one such position per LOGPROB_FLIPS_PER positions compared.
LOGPROB_TOL = 5e-3
LOGPROB_FLIPS_PER = 200


def assert_same_logprobs(ref: dict, test: dict) -> float:
    """On CPU, every gap of :func:`logprob_gaps` within ``LOGPROB_TOL``, but for one rounding flip per
    ``LOGPROB_FLIPS_PER`` positions (each within ``TIE_TOL`` times the other tokens' probability); on a GPU (Bole's
    kernels round differently from vLLM's there) the tokens alone are checked. Returns the largest gap."""
    import torch

    gaps = logprob_gaps(ref, test)
    worst = max((gap for gap, _ in gaps), default=0.0)
    if not torch.cuda.is_available():
        over = [(gap, p) for gap, p in gaps if gap >= LOGPROB_TOL]
        flips = max(1, len(gaps) // LOGPROB_FLIPS_PER)
        assert len(over) <= flips and all(gap <= LOGPROB_TOL + TIE_TOL * (1 - p) for gap, p in over), \
            f"the target's logprobs moved by {worst:.2e} at {len(over)} of {len(gaps)} positions (a wrong position?)"
    return worst


def vocab_size(model_dir: str) -> int:
    """The tiny checkpoint's vocabulary size (its config's text part, where it has one: Qwen3.5 and Qwen3.5-MoE;
    Qwen3-Next's config is flat)."""
    config = json.load(open(f"{model_dir}/config.json"))
    return config.get("text_config", config)["vocab_size"]


def random_requests(vocab: int, prompt_lens, max_tokens: int, seed: int = 1234) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": [rng.randrange(10, vocab) for _ in range(n)], "max_tokens": max_tokens} for n in prompt_lens]


def write_oracle(tmp_path, requests, ref: dict):
    path = tmp_path / "oracle.json"
    path.write_text(json.dumps([{"prompt": r["prompt"], "output": o["tokens"]}
                                for r, o in zip(requests, ref["outputs"])]))
    return path


def bole_engine(tmp_path, name, depth, topk, budget, drafter="planted", selection=None, **engine) -> dict:
    """LLM kwargs for a Bole run; the planted drafter reads ``oracle.json`` and logs its trees to ``<name>.stats.jsonl``."""
    spec = {"method": "bole", "num_speculative_tokens": depth, "topk": topk, "budget": budget}
    if selection is not None:
        spec["selection"] = selection
    if drafter == "planted":
        spec["drafter"] = "vllm_bole.testing.planted_drafter:PlantedDrafter"
        spec["drafter_args"] = {"oracle": str(tmp_path / "oracle.json"), "seed": depth * 10 + topk,
                                "stats": str(tmp_path / f"{name}.stats.jsonl")}
    return {"speculative_config": spec, **engine}


def full_vocab(engine: dict) -> dict:
    """``engine`` (:func:`bole_engine`'s kwargs) with the MTP drafter over the full vocabulary: a tiny model's random
    weights spread its output over the whole vocabulary, which the default draft vocabulary (an eighth of it,
    learned from the output) does not cover in a short run; tests of the MTP head's acceptance take it whole."""
    engine["speculative_config"]["draft_vocab"] = None
    return engine


def tiny_budget_table(path, model_dir: str, batch_sizes=(1, 2, 4, 8, 16), nodes=(16, 32, 64)):
    """A calibration table for a tiny checkpoint on this device with made-up times (T_ver 20% up per point, so
    B_ver is the smallest N and the rule "throughput" has the larger ones to choose from): for engines whose budget
    rule must be in charge (without T_ver curves it runs as "decode"). Returns ``path``."""
    from types import SimpleNamespace

    from vllm_bole.spec_decode.budget_table import device_name, make_entry, model_fingerprint, write_table

    config = json.load(open(f"{model_dir}/config.json"))
    text = config.get("text_config", config)
    text = SimpleNamespace(**{k: text[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")})
    model = SimpleNamespace(hf_config=SimpleNamespace(architectures=config["architectures"]), hf_text_config=text,
                            dtype="bfloat16")   # the tiny engines' dtype (testing.tiny_models.engine_kwargs)
    points = [{"nodes": n, "t_ver_ms": 10.0 * 1.2 ** i, "samples": 1, "kv_len_mean": 256}
              for i, n in enumerate(nodes)]
    write_table(path, [make_entry(fingerprint=model_fingerprint(model), model=model_dir, gpu=device_name(),
                                  batch_size=b, kv_len=256, epsilon=0.1, t_dec_ms=10.0,
                                  points=[dict(p) for p in points], tree={"shape": "beam"}, device_timing="made up")
                       for b in batch_sizes])
    return path


def sync_and_async_runs(tmp_path) -> dict[str, dict]:
    """Two Bole engine specs for :func:`run_engine` over a batch of up to 8 requests: the planted drafter scheduled
    synchronously, and the MTP drafter under vLLM's async scheduling (run on CPU too)."""
    return {
        "planted_sync": {"engine": bole_engine(tmp_path, "planted_sync", depth=4, topk=3, budget=512,
                                               max_num_seqs=8, async_scheduling=False)},
        "mtp_async": {"engine": bole_engine(tmp_path, "mtp_async", depth=3, topk=2, budget=48, drafter="mtp",
                                            max_num_seqs=8) | {"async_scheduling": True},
                      "cpu_async_scheduling": True},
    }


def chi_square_two_sample(a: list, b: list, min_count: int = 10) -> tuple[float, float, int]:
    """Chi-square test of homogeneity of two samples of categories; categories with fewer than ``min_count``
    observations in both samples together are pooled. Returns (statistic, p-value, degrees of freedom)."""
    from scipy.stats import chi2_contingency

    ca, cb = Counter(a), Counter(b)
    keys = sorted(set(ca) | set(cb), key=str)
    big = [k for k in keys if ca[k] + cb[k] >= min_count]
    small = [k for k in keys if ca[k] + cb[k] < min_count]
    table = [[ca[k] for k in big], [cb[k] for k in big]]
    if sum(ca[k] + cb[k] for k in small) >= min_count:
        table[0].append(sum(ca[k] for k in small))
        table[1].append(sum(cb[k] for k in small))
    stat, p, dof, _ = chi2_contingency(table)
    return float(stat), float(p), int(dof)
