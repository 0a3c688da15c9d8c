"""Measure T_ver(N) against T_dec on a running in-process Bole engine and turn the curves into table entries.

For each batch size B and KV length L: B requests with L-token prompts are decoded step by step through
``LLMEngine.step``; between steps the calibration drafter is set to N nodes for the whole batch (N/B per
request, shape fixed) and synthetic acceptance accepts nothing, so every step verifies exactly the same forest.
The target model's forward (``_model_forward``) of each step is timed with CUDA events (on CPU: wall clock;
CPU forwards are synchronous). Per N the first ``warmup`` matching steps are dropped and the median of the next
``steps`` is kept; T_dec is the median of the no-draft steps (1 token per request) measured before and after the
N sweep. The context grows by one token per step, so each point records its mean context length.
"""

import dataclasses
import random
import statistics
import time
from contextlib import contextmanager

import torch

from .._vllm_compat import model_runner_of, set_step_methods, step_methods
from ..logger import init_logger
from ..spec_decode.budget import reload_budget_tables
from ..spec_decode.budget_table import device_name, make_entry, model_fingerprint, write_table
from ..spec_decode.synthetic import SyntheticAcceptance
from .drafter import FixedShapeDrafter, max_shape_nodes

logger = init_logger(__name__)

DEFAULT_NODES = (8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


def engine_runner(llm):
    """The Bole model runner of an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    from ..worker.model_runner import BoleModelRunnerMixin

    try:
        runner = model_runner_of(llm)
    except AttributeError:
        raise RuntimeError("calibration needs an in-process engine: set VLLM_ENABLE_V1_MULTIPROCESSING=0") from None
    if not isinstance(runner, BoleModelRunnerMixin):
        raise RuntimeError('calibration needs an engine with speculative_config {"method": "bole", ...}')
    return runner


class ForwardTimer:
    """Times every target forward of a runner and notes what the step scheduled (instance-level wrappers)."""

    def __init__(self, runner):
        self.runner = runner
        self.samples: list[dict] = []
        self._pending: list[tuple[dict, object, object]] = []
        self._cuda = runner.device.type == "cuda"
        self._step: dict | None = None
        prepare, forward = step_methods(runner)

        def timed_prepare(scheduler_output, num_scheduled_tokens, *args, **kwargs):
            out = prepare(scheduler_output, num_scheduled_tokens, *args, **kwargs)
            num_reqs = len(num_scheduled_tokens)
            drafts = {r: len(d) for r, d in scheduler_output.scheduled_spec_decode_tokens.items()}
            plain = all(n == 1 + drafts.get(r, 0) for r, n in scheduler_output.num_scheduled_tokens.items())
            self._step = {"num_reqs": num_reqs, "nodes": sum(drafts.values()) if plain else -1,
                          "context": float(runner.input_batch.num_computed_tokens_cpu[:num_reqs].mean())}
            return out

        def timed_forward(*args, **kwargs):
            step, self._step = self._step, None
            if step is None:  # not a scheduled step (e.g. a dummy or profiling run)
                return forward(*args, **kwargs)
            if self._cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = forward(*args, **kwargs)
                end.record()
                self._pending.append((step, start, end))
            else:
                t0 = time.perf_counter()
                out = forward(*args, **kwargs)
                step["ms"] = (time.perf_counter() - t0) * 1e3
                self.samples.append(step)
            return out

        set_step_methods(runner, timed_prepare, timed_forward)

    def collect(self) -> list[dict]:
        """All samples so far (waits for pending CUDA events); clears them."""
        for step, start, end in self._pending:
            end.synchronize()
            step["ms"] = start.elapsed_time(end)
            self.samples.append(step)
        self._pending.clear()
        out, self.samples = self.samples, []
        return out

    def remove(self) -> None:
        set_step_methods(self.runner, None, None)


@contextmanager
def calibration_mode(runner, budget: int, shape: str, seed: int = 0):
    """Run a Bole runner with the fixed-shape drafter, a fixed node budget and no accepted drafts; restores the
    runner's drafter, config and acceptance afterwards. Yields (drafter, timer)."""
    saved = runner.bole_drafter, runner.bole_config, runner._bole_synthetic
    cfg = dataclasses.replace(runner.bole_config, budget=budget, budget_rule="decode",
                              drafter_args={"shape": shape, "seed": seed, "nodes": 0})
    runner.bole_config = cfg
    runner.bole_drafter = drafter = FixedShapeDrafter(runner, cfg)
    runner._bole_synthetic = SyntheticAcceptance(rates=(0.0,), sibling_rates=(), seed=seed)
    timer = ForwardTimer(runner)
    try:
        yield drafter, timer
    finally:
        timer.remove()
        runner.bole_drafter, runner.bole_config, runner._bole_synthetic = saved


@dataclasses.dataclass
class SweepPlan:
    batch_sizes: list[int]
    kv_lens: list[int]
    nodes: list[int]
    epsilon: float = 0.1
    warmup: int = 3
    steps: int = 10
    shape: str = "beam"
    seed: int = 0

    def nodes_for(self, batch_size: int, per_request: int, max_tokens: int) -> list[int]:
        """The grid's N that B requests can carry (per-request cap) and one step can schedule."""
        return [n for n in self.nodes if n <= batch_size * per_request and batch_size + n <= max_tokens]

    def decode_steps(self, num_points: int) -> int:
        return (num_points + 2) * (self.warmup + self.steps + 1)


def _median_of(samples: list[dict], batch_size: int, nodes: int, warmup: int, steps: int) -> dict | None:
    match = [s for s in samples if s["num_reqs"] == batch_size and s["nodes"] == nodes][warmup:warmup + steps]
    if not match:
        return None
    return {"nodes": nodes, "t_ver_ms": round(statistics.median(s["ms"] for s in match), 4),
            "samples": len(match), "kv_len_mean": round(statistics.fmean(s["context"] for s in match), 1)}


def _run_phase(engine, drafter, timer, nodes: int, num_steps: int) -> list[dict]:
    drafter.total_nodes = nodes
    timer.collect()
    for _ in range(num_steps):
        engine.step()
    return timer.collect()


def calibrate(llm, plan: SweepPlan, progress: bool = True) -> list[dict]:
    """Sweep ``plan`` on an in-process Bole engine; returns one table entry per (batch size, KV length)."""
    from tqdm import tqdm
    from vllm import SamplingParams

    runner = engine_runner(llm)
    engine = llm.llm_engine
    cfg = runner.bole_config
    per_request = min(cfg.max_nodes_per_request, max_shape_nodes(plan.shape, cfg.topk, cfg.max_depth))
    max_tokens = runner.scheduler_config.max_num_scheduled_tokens or runner.scheduler_config.max_num_batched_tokens
    max_len = runner.model_config.max_model_len
    max_seqs = runner.scheduler_config.max_num_seqs
    if max(plan.batch_sizes) > max_seqs:
        raise ValueError(f"batch sizes {plan.batch_sizes} exceed the engine's max_num_seqs={max_seqs}")
    grids = {b: plan.nodes_for(b, per_request, max_tokens) for b in plan.batch_sizes}
    longest = max(plan.kv_lens) + max(plan.decode_steps(len(g)) for g in grids.values()) + 8 + per_request
    if longest > max_len:
        raise ValueError(f"kv_lens up to {max(plan.kv_lens)} need max_model_len >= {longest}, got {max_len}")
    fingerprint, gpu = model_fingerprint(runner.model_config), device_name()
    rng = random.Random(plan.seed)
    vocab = runner.model_config.get_vocab_size()
    entries = []
    bar = tqdm(total=sum(len(g) + 2 for g in grids.values()) * len(plan.kv_lens), desc="calibrating",
               disable=not progress)
    with calibration_mode(runner, budget=max(max(g, default=1) for g in grids.values()), shape=plan.shape,
                          seed=plan.seed) as (drafter, timer):
        for b in plan.batch_sizes:
            for kv in plan.kv_lens:
                grid = grids[b]
                ids = [f"bole-calibrate-{b}-{kv}-{i}" for i in range(b)]
                params = SamplingParams(max_tokens=plan.decode_steps(len(grid)) + 8, ignore_eos=True,
                                        temperature=0.0, detokenize=False)
                drafter.total_nodes = 0
                for rid in ids:
                    engine.add_request(rid, {"prompt_token_ids": [rng.randrange(vocab) for _ in range(kv)]},
                                       params)
                for _ in range(kv * b // max_tokens + 64):  # prefill until a plain decode step of all B runs
                    engine.step()
                    if any(s["num_reqs"] == b and s["nodes"] == 0 for s in timer.collect()):
                        break
                n_steps = plan.warmup + plan.steps + 1
                dec = _run_phase(engine, drafter, timer, 0, n_steps)
                bar.update()
                points = []
                for n in grid:
                    point = _median_of(_run_phase(engine, drafter, timer, n, n_steps), b, n, plan.warmup,
                                       plan.steps)
                    if point is None:
                        logger.warning("calibration: no step verified %d nodes at batch %d, KV %d", n, b, kv)
                    else:
                        points.append(point)
                    bar.update()
                dec += _run_phase(engine, drafter, timer, 0, n_steps)
                bar.update()
                engine.abort_request(ids)
                while engine.has_unfinished_requests():
                    engine.step()
                dec_ms = [s["ms"] for s in dec if s["num_reqs"] == b and s["nodes"] == 0]
                dec_ms = dec_ms[plan.warmup:] if len(dec_ms) > plan.warmup else dec_ms
                if not dec_ms or not points:
                    raise RuntimeError(f"calibration measured nothing at batch {b}, KV {kv} (preempted? "
                                       "raise the KV cache size or lower batch sizes / KV lengths)")
                entries.append(make_entry(
                    fingerprint=fingerprint, model=runner.model_config.model.rstrip("/").rsplit("/", 1)[-1],
                    gpu=gpu, batch_size=b, kv_len=kv, epsilon=plan.epsilon, t_dec_ms=statistics.median(dec_ms),
                    points=points, tree={"shape": plan.shape, "topk": cfg.topk, "max_depth": cfg.max_depth},
                    device_timing="cuda_events" if runner.device.type == "cuda" else "wall_clock"))
    bar.close()
    return entries


def save(entries: list[dict], path) -> list[dict]:
    """Merge into the table at ``path`` and make this process's ``budget "auto"`` read it again."""
    rows = write_table(path, entries)
    reload_budget_tables()
    return rows


def summary(entries: list[dict]) -> str:
    """A markdown table: T_dec, B_ver and T_ver(N)/T_dec per batch size and KV length."""
    nodes = sorted({p["nodes"] for e in entries for p in e["points"]})
    head = ["B", "KV", "T_dec ms", "B_ver"] + [f"N={n}" for n in nodes]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in sorted(entries, key=lambda e: (e["batch_size"], e["kv_len"])):
        ratio = {p["nodes"]: f"{p['ratio']:.2f}" for p in e["points"]}
        b_ver = f"{e['b_ver']}{'+' if e['limited_by_grid'] else ''}"
        lines.append("| " + " | ".join([str(e["batch_size"]), str(e["kv_len"]), f"{e['t_dec_ms']:.2f}", b_ver]
                                       + [ratio.get(n, "") for n in nodes]) + " |")
    eps = sorted({e["epsilon"] for e in entries})
    lines.append(f"(T_ver/T_dec; B_ver = largest N within 1+epsilon, epsilon {eps}; '+': the largest N measured)")
    return "\n".join(lines)


def plot(entries: list[dict], path) -> bool:
    """T_ver(N)/T_dec per batch size, one panel per KV length; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    kvs = sorted({e["kv_len"] for e in entries})
    fig, axes = plt.subplots(1, len(kvs), figsize=(5 * len(kvs), 4), squeeze=False)
    for ax, kv in zip(axes[0], kvs):
        for e in sorted((e for e in entries if e["kv_len"] == kv), key=lambda e: e["batch_size"]):
            ax.plot([p["nodes"] for p in e["points"]], [p["ratio"] for p in e["points"]], marker="o",
                    label=f"B={e['batch_size']} (B_ver {e['b_ver']})")
            ax.axhline(1 + e["epsilon"], color="gray", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree nodes per step N")
        ax.set_ylabel("T_ver(N) / T_dec")
        ax.set_title(f"{entries[0]['gpu']}, KV {kv}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
