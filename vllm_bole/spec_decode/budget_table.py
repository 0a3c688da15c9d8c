"""The calibrated node-budget table: its JSON schema, how entries are computed, merged and looked up.

File layout (``format`` ``"vllm-bole-budget-table"``, ``version`` 1)::

    {"format": "vllm-bole-budget-table", "version": 1,
     "entries": [
       {"fingerprint": "Qwen3_5ForConditionalGeneration:h4096:l32:v248320:bfloat16",  # model key (shapes, dtype)
        "model": "qwen3.5-9b-shape",       # for people: the checkpoint's name
        "gpu": "NVIDIA H200",              # vllm.platforms.current_platform.get_device_name()
        "batch_size": 8, "kv_len": 256,    # the bucket: requests per step, context tokens per request
        "b_ver": 192,                      # max{N : T_ver(N) <= (1 + epsilon) T_dec}; 0 if no N qualifies
        "limited_by_grid": false,          # true when the largest N measured qualified (b_ver may be higher)
        "epsilon": 0.1,
        "t_dec_ms": 5.12,                  # median target forward of the plain decode step (1 token per request)
        "points": [{"nodes": 8,            # N: tree nodes verified in the step over the whole batch
                    "t_ver_ms": 5.20,      # median target forward of that verification step
                    "ratio": 1.016,        # t_ver_ms / t_dec_ms
                    "samples": 10,         # timed steps (warm-up steps discarded)
                    "kv_len_mean": 261.5}],  # mean context length over the timed steps
        "tree": {"shape": "beam", "topk": 4, "max_depth": 8},
        "device_timing": "cuda_events",    # or "wall_clock" (CPU, synchronous)
        "vllm_version": "0.26.0", "created": "2026-11-20T10:00:00+00:00"}]}

An entry is keyed by (fingerprint, gpu, batch_size, kv_len); writing a table replaces entries with the same key
and keeps the rest. The fingerprint names what the timing depends on (architecture, hidden size, layers,
vocabulary, dtype), so a table measured with dummy weights serves the real checkpoint of the same shape.

Lookup (``budget "auto"``): the smallest calibrated batch size >= the step's (the largest one beyond), then the
smallest calibrated KV length >= the context length (the largest beyond); without a context length, the smallest
budget over that batch size's KV lengths. With ``budget_rule "step"`` the same entry's points give the largest N
with T_ver(N) <= (1 + epsilon) T_dec + epsilon * (the step's measured time besides its target forward); with
``"throughput"`` the N with the most expected tokens per unit of step time.
"""

import bisect
import datetime
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from .. import envs

TABLE_FORMAT = "vllm-bole-budget-table"
TABLE_VERSION = 1
_KEY = ("fingerprint", "gpu", "batch_size", "kv_len")


def default_table_path() -> Path:
    """``$VLLM_BOLE_BUDGET_TABLE``, else ``budget_table.json`` in ``$VLLM_BOLE_CACHE`` or ``~/.cache/vllm-bole``."""
    if envs.VLLM_BOLE_BUDGET_TABLE:
        return Path(envs.VLLM_BOLE_BUDGET_TABLE)
    return Path(envs.VLLM_BOLE_CACHE or Path.home() / ".cache" / "vllm-bole") / "budget_table.json"


def model_fingerprint(model_config) -> str:
    """What verification time depends on: architecture, hidden size, layers, vocabulary, dtype."""
    text = model_config.hf_text_config
    arch = (getattr(model_config.hf_config, "architectures", None) or ["unknown"])[0]
    dtype = str(model_config.dtype).removeprefix("torch.")
    return f"{arch}:h{text.hidden_size}:l{text.num_hidden_layers}:v{text.vocab_size}:{dtype}"


def device_name() -> str:
    from vllm.platforms import current_platform

    return current_platform.get_device_name()


def budget_from_curve(points: list[dict], t_dec_ms: float, epsilon: float,
                      fixed_ms: float = 0.0) -> tuple[int, bool]:
    """(B_ver, limited_by_grid): the largest measured N with t_ver <= (1 + epsilon) t_dec (0 if none), and
    whether that N is the largest one measured. ``fixed_ms``: the rest of a step besides its target forward
    (the "step" rule): N may cost up to epsilon of the whole plain step more, t_ver <= t_dec + epsilon (t_dec +
    fixed_ms); 0 is the calibrated B_ver."""
    limit = (1.0 + epsilon) * t_dec_ms + epsilon * fixed_ms
    fitting = [p["nodes"] for p in points if p["t_ver_ms"] <= limit]
    if not fitting:
        return 0, False
    best = max(fitting)
    return best, best == max(p["nodes"] for p in points)


def make_entry(*, fingerprint: str, model: str, gpu: str, batch_size: int, kv_len: int, epsilon: float,
               t_dec_ms: float, points: list[dict], tree: dict, device_timing: str) -> dict:
    points = sorted(points, key=lambda p: p["nodes"])
    for p in points:
        p["ratio"] = round(p["t_ver_ms"] / t_dec_ms, 4)
    b_ver, limited = budget_from_curve(points, t_dec_ms, epsilon)
    import vllm

    return {"fingerprint": fingerprint, "model": model, "gpu": gpu, "batch_size": batch_size, "kv_len": kv_len,
            "b_ver": b_ver, "limited_by_grid": limited, "epsilon": epsilon, "t_dec_ms": round(t_dec_ms, 4),
            "points": points, "tree": tree, "device_timing": device_timing, "vllm_version": vllm.__version__,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def read_table(path: str | os.PathLike) -> list[dict]:
    """The entries of a table file; raises ValueError naming the file for anything that is not one."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or data.get("format") != TABLE_FORMAT or data.get("version") != TABLE_VERSION:
        raise ValueError(f"{path}: not a {TABLE_FORMAT} version {TABLE_VERSION} file")
    entries = data.get("entries")
    if not isinstance(entries, list) or not all(isinstance(e, dict) and all(k in e for k in _KEY + ("b_ver",))
                                                for e in entries):
        raise ValueError(f"{path}: every entry needs {list(_KEY) + ['b_ver']}")
    return entries


def write_table(path: str | os.PathLike, entries: list[dict]) -> list[dict]:
    """Merge ``entries`` into the table at ``path`` (same key: replaced) and write it atomically; returns all."""
    path = Path(path)
    merged = {tuple(e[k] for k in _KEY): e for e in (read_table(path) if path.exists() else [])}
    merged |= {tuple(e[k] for k in _KEY): e for e in entries}
    rows = sorted(merged.values(), key=lambda e: tuple(e[k] for k in _KEY))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"format": TABLE_FORMAT, "version": TABLE_VERSION, "entries": rows}, indent=1) + "\n")
    tmp.replace(path)
    return rows


@dataclass
class ModelBudgets:
    """One (model, GPU) slice of a table, ready for per-step lookups."""

    fingerprint: str
    gpu: str
    batch_sizes: list[int]
    kv_lens: dict[int, list[int]]             # batch size -> sorted KV lengths
    b_ver: dict[tuple[int, int], int]         # (batch size, kv length) -> budget
    curves: dict[tuple[int, int], tuple[float, float, list[dict]]] = field(default_factory=dict)  # t_dec, eps, pts
    _memo: dict = field(default_factory=dict, repr=False)
    KEEP_MARGIN = 0.03   # lookup_throughput: how much better another N must look than the one chosen last
    measured = False     # MeasuredBudgets: no calibration, whole steps measured instead

    @classmethod
    def from_entries(cls, entries: list[dict]) -> "ModelBudgets":
        b_ver = {(int(e["batch_size"]), int(e["kv_len"])): int(e["b_ver"]) for e in entries}
        curves = {(int(e["batch_size"]), int(e["kv_len"])): (float(e["t_dec_ms"]), float(e["epsilon"]),
                                                             sorted(e["points"], key=lambda p: p["nodes"]))
                  for e in entries if e.get("points")}
        batch_sizes = sorted({b for b, _ in b_ver})
        kv_lens = {b: sorted(kv for bb, kv in b_ver if bb == b) for b in batch_sizes}
        return cls(entries[0]["fingerprint"], entries[0]["gpu"], batch_sizes, kv_lens, b_ver, curves)

    def _keys(self, batch_size: int, context_len: int | None) -> list[tuple[int, int]]:
        """The calibrated buckets a step falls in (all KV lengths of its batch size when the context is unknown)."""
        b = self.batch_sizes[min(bisect.bisect_left(self.batch_sizes, batch_size), len(self.batch_sizes) - 1)]
        kvs = self.kv_lens[b]
        if context_len is None:
            return [(b, kv) for kv in kvs]
        return [(b, kvs[min(bisect.bisect_left(kvs, context_len), len(kvs) - 1)])]

    def lookup(self, batch_size: int, context_len: int | None = None) -> int:
        key = (batch_size, context_len)
        if key not in self._memo:
            budget = min(self.b_ver[k] for k in self._keys(batch_size, context_len))
            if len(self._memo) > 65536:
                self._memo.clear()
            self._memo[key] = budget
        return self._memo[key]

    def lookup_step(self, batch_size: int, context_len: int | None, fixed_ms: float) -> int:
        """The "step" rule: :func:`budget_from_curve` with the step's time outside its target forward (B_ver
        for a bucket without its curve)."""
        return min(budget_from_curve(self.curves[k][2], self.curves[k][0], self.curves[k][1], fixed_ms)[0]
                   if k in self.curves else self.b_ver[k] for k in self._keys(batch_size, context_len))

    def lookup_throughput(self, batch_size: int, context_len: int | None, rest_ms, tokens, probe: int = 0,
                          keep: int | None = None) -> int:
        """The "throughput" rule: the calibrated N, at least B_ver, with the most expected tokens per millisecond,
        ``tokens(N) / (rest(N) + T_ver(N))`` (the smaller N on a tie; B_ver for a bucket without its curve).
        Never below B_ver: up to it a node costs next to nothing by the calibration's own measure, and on the H200
        the sizes the rule chose below it ran slower than B_ver at batch 1 and 8 (benchmarks/e2e.py on an H200).
        ``rest_ms``: the step's time besides its target forward, in ms, or N -> that time; ``keep``: the N chosen
        last, kept unless another is better by more than ``KEEP_MARGIN`` (estimates that wobble would otherwise
        switch sizes, and each new size is a new CUDA graph); ``probe``: take the calibrated N that many places
        above (below, if negative) the choice instead (within the curve from B_ver)."""
        def best(key):
            points = self._rated_points(key, rest_ms, tokens)
            if not points:
                return self.b_ver[key]
            rate = [p["tokens_per_ms"] for p in points]
            i = max(range(len(points)), key=lambda j: (rate[j], -j))
            kept = next((j for j, p in enumerate(points) if p["nodes"] == keep), None)
            if kept is not None and rate[i] <= (1.0 + self.KEEP_MARGIN) * rate[kept]:
                i = kept
            return points[min(max(i + probe, 0), len(points) - 1)]["nodes"]

        return min(best(k) for k in self._keys(batch_size, context_len))

    def _candidates(self, key, rest_ms) -> list[dict]:
        """The points of ``key`` the throughput rule chooses from: the calibrated ones from B_ver up."""
        return [p for p in self.curves[key][2] if p["nodes"] >= self.b_ver[key]] if key in self.curves else []

    def _rated_points(self, key, rest_ms, tokens) -> list[dict]:
        """The candidate points of ``key`` (:meth:`_candidates`), each with the rest, the expected tokens and their
        rate ``tokens(N) / (rest(N) + T_ver(N))`` (``rest_ms``: ms, or N -> ms); empty without a curve."""
        rest = rest_ms if callable(rest_ms) else (lambda n: rest_ms)
        rated = []
        for p in self._candidates(key, rest_ms):
            r, t = rest(p["nodes"]), tokens(p["nodes"])
            rated.append({"nodes": p["nodes"], "t_ver_ms": p["t_ver_ms"], "rest_ms": r, "tokens": t,
                          "tokens_per_ms": t / max(r + p["t_ver_ms"], 1e-3)})   # (measured: a fit at 0)
        return rated

    def throughput_estimates(self, batch_size: int, context_len: int | None, rest_ms, tokens) -> list[dict]:
        """What :meth:`lookup_throughput` weighs, per calibrated N from B_ver up, for the step's bucket (the first
        when the context is unknown): nodes, T_ver, the rest, the expected tokens and their rate per ms (for
        reports; empty without a curve)."""
        digits = {"t_ver_ms": 3, "rest_ms": 3, "tokens": 3, "tokens_per_ms": 4}
        return [{k: round(v, digits[k]) if k in digits else v for k, v in p.items()}
                for p in self._rated_points(self._keys(batch_size, context_len)[0], rest_ms, tokens)]

    def t_ver_ms(self, batch_size: int, context_len: int | None, nodes: int) -> float | None:
        """The calibrated target forward of a step verifying ``nodes`` nodes: linear between the measured
        points (N = 0 is the plain decode step), along the last segment beyond them; None without a curve."""
        key = self._keys(batch_size, context_len)[0]
        if key not in self.curves:
            return None
        t_dec, _, points = self.curves[key]
        xs = [0] + [p["nodes"] for p in points]
        ys = [t_dec] + [p["t_ver_ms"] for p in points]
        i = min(max(bisect.bisect_left(xs, nodes), 1), len(xs) - 1)
        slope = (ys[i] - ys[i - 1]) / max(xs[i] - xs[i - 1], 1)
        return ys[i - 1] + slope * (nodes - xs[i - 1])


# speculative_config.budget_table "measured": no calibration table (:class:`MeasuredBudgets`).
MEASURED = "measured"

# budget "auto" without a calibration table (default_budget): DEFAULT_NODES_PER_REQUEST nodes a request up to
# DEFAULT_STEP_NODES a step, where the H100's and H200's forwards at Qwen3.5-9B shapes stop being nearly flat in
# the nodes (batch 16-64); at least DEFAULT_AUTO_BUDGET a step (the A100 peak in the Bole paper) and
# MIN_NODES_PER_REQUEST a request (what vLLM's MTP chain of 3 verifies). On an H100 this rule's full-batch steps ran
# 1.44x, 1.33x, 1.16x and 1.06x the tokens/s of vLLM's MTP k=3 at batch 1, 16, 32 and 64 (docs/results.md, "The
# default without a calibration table (H100)"); benchmarks/budget_rules.py prices it at 0.97-1.0 of the best size
# from batch 1 to 64.
DEFAULT_AUTO_BUDGET = 128
DEFAULT_NODES_PER_REQUEST = 8
DEFAULT_STEP_NODES = 384
MIN_NODES_PER_REQUEST = 3


def _rule_text(step_nodes: int, min_step_nodes: int) -> str:
    return (f"{DEFAULT_NODES_PER_REQUEST} nodes per request up to {step_nodes} per step, at least {min_step_nodes} "
            f"per step and {MIN_NODES_PER_REQUEST} per request")


DEFAULT_BUDGET_RULE = _rule_text(DEFAULT_STEP_NODES, DEFAULT_AUTO_BUDGET)


# The same without a table for mixture-of-experts models: every node's token reads the weights of the experts it
# routes to, so a step's cost grows with its nodes until nearly every expert is read, and the dense rule's floor of
# 128 nodes a step is not free. On the Qwen3.5-35B-A3B shape (H100, docs/results.md "A Qwen3.5-MoE shape"), 128
# nodes a step ran 1.15x the full-batch tok/s of vLLM's MTP k=3 at batch 1 (32 nodes: one request's largest tree)
# and 1.11x at batch 32 (4 a request), but 0.88x at batch 8 (16 a request): a step 1.6x the chain's for 1.4x its
# tokens. So: 8 nodes a request up to MOE_STEP_NODES a step, at least MOE_MIN_STEP_NODES a step.
MOE_STEP_NODES = 128
MOE_MIN_STEP_NODES = 32
MOE_BUDGET_RULE = _rule_text(MOE_STEP_NODES, MOE_MIN_STEP_NODES) + " (a mixture-of-experts model)"


def is_moe(model_config) -> bool:
    """Whether vLLM's ``model_config`` is a mixture-of-experts model (its text config has routed experts)."""
    text = getattr(model_config, "hf_text_config", None)
    return bool(getattr(text, "num_experts", None))


def default_budget(batch_size: int, moe: bool = False) -> int:
    """The node budget of a step of ``batch_size`` requests without a calibration table (:func:`default_rule`)."""
    floor, cap = (MOE_MIN_STEP_NODES, MOE_STEP_NODES) if moe else (DEFAULT_AUTO_BUDGET, DEFAULT_STEP_NODES)
    return max(floor, min(DEFAULT_NODES_PER_REQUEST * batch_size, cap), MIN_NODES_PER_REQUEST * batch_size)


def default_rule(moe: bool = False) -> str:
    """:func:`default_budget`'s rule in words, for a mixture-of-experts model (``moe``) or a dense one."""
    return MOE_BUDGET_RULE if moe else DEFAULT_BUDGET_RULE


@dataclass
class MeasuredBudgets(ModelBudgets):
    """``budget_table: "measured"``: the throughput rule without a calibration table. Each batch size B gets the
    candidate sizes B x ``NODES_PER_REQUEST`` (up to ``per_request`` nodes a request), all priced at T_ver 0, so
    the rule's step clock measures whole steps (target forward included) as the "rest" and fits their growth with
    the nodes per request (``budget.StepClock``); it climbs one size above those measured lately at a time, its
    probes try the neighbouring sizes, and the rule settles where the expected tokens per millisecond of measured
    step peak. The smallest candidate, one node a request (a chain of one), is the floor; until a batch size has
    measurements its steps take :func:`default_budget` nodes (within its candidates' range)."""

    per_request: int = 32
    moe: bool = False   # its steps before measurements: default_budget's rule for a mixture-of-experts model
    measured = True
    NODES_PER_REQUEST = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)

    @classmethod
    def for_requests(cls, per_request: int, moe: bool = False) -> "MeasuredBudgets":
        return cls(MEASURED, MEASURED, [], {}, {}, {}, per_request=per_request, moe=moe)

    def _keys(self, batch_size: int, context_len: int | None) -> list[tuple[int, int]]:
        key = (batch_size, 0)   # every batch size its own candidates; the context is not priced
        if key not in self.b_ver:
            sizes = sorted({batch_size * q for q in self.NODES_PER_REQUEST if q <= self.per_request}
                           | {batch_size * self.per_request})
            self.b_ver[key] = sizes[0]
            self.curves[key] = (0.0, 0.0, [{"nodes": n, "t_ver_ms": 0.0} for n in sizes])
        return [key]

    def lookup(self, batch_size: int, context_len: int | None = None) -> int:
        return min(default_budget(batch_size, self.moe), batch_size * self.per_request)

    def _candidates(self, key, rest_ms) -> list[dict]:
        """Up to the first size above what the step clock measured lately (``RestModel.reach``): its line prices
        larger ones by extrapolation, flat while its slope is unknown, which would send the rule to the largest
        trees at once (a step of thousands of nodes at a large batch), and again whenever the fit has forgotten
        them. So the rule climbs one size at a time, as fast as the sizes get measured."""
        points = super()._candidates(key, rest_ms)
        reach = getattr(rest_ms, "reach", None)
        if reach is None:
            return points
        above = [i for i, p in enumerate(points) if p["nodes"] > reach * key[0] + 1e-9]
        return points[:above[0] + 1] if above else points


def select_model(entries: list[dict], gpu: str, fingerprint: str | None) -> tuple[ModelBudgets | None, str]:
    """The table's budgets for this GPU and model (fingerprint None: the only model calibrated on this GPU),
    or None and why not."""
    on_gpu = [e for e in entries if e["gpu"] == gpu]
    if not on_gpu:
        return None, f"no entry for GPU {gpu!r} (has {sorted({e['gpu'] for e in entries})})"
    models = sorted({e["fingerprint"] for e in on_gpu})
    if fingerprint is None:
        if len(models) != 1:
            return None, f"the model is unknown here and {len(models)} models are calibrated on {gpu!r}"
        fingerprint = models[0]
    mine = [e for e in on_gpu if e["fingerprint"] == fingerprint]
    if not mine:
        return None, f"no entry for model {fingerprint!r} on {gpu!r} (has {models})"
    return ModelBudgets.from_entries(mine), ""
