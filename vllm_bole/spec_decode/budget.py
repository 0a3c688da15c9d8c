"""Per-step node budget: how many tree nodes one verification step carries over the whole batch.

``budget`` is an int, or ``"auto"``: the calibrated B_ver for this model, GPU, batch size and (when the caller
knows it) context length, read once per process from the table written by ``vllm-bole calibrate`` (path:
``budget_table`` in the speculative config, else ``$VLLM_BOLE_BUDGET_TABLE``, else
``~/.cache/vllm-bole/budget_table.json``; see :mod:`vllm_bole.spec_decode.budget_table`). Without a usable table it
logs one warning saying why and uses ``budget_table.default_budget``.

``budget_rule``: ``"decode"`` uses the table's B_ver, the largest N with T_ver(N) <= (1+eps) T_dec:
right when a step is mostly its target forward. ``"step"`` also counts what the step spends besides the target
forward (drafting, sampling, scheduling: :class:`StepClock` measures it per batch bucket), and allows N to cost up
to eps of that whole plain step more: T_ver(N) <= T_dec + eps * (T_dec + T_rest). With T_rest = 0 both agree;
until the clock has a measurement the step rule uses B_ver. ``"throughput"`` (the default with ``"auto"``) picks,
among the calibrated N from B_ver up, the one with the most expected tokens per unit of step time: tokens(N) /
(T_rest(N) + T_ver(N)), where tokens(N) is what the batch's trees of N nodes are expected to accept
(``spec_decode/acceptance_model.py``, from the walks so far) and T_rest(N) the rest's fit over the node counts of
recent steps (:meth:`StepClock.rest_model`); until both are measured it uses B_ver. Where no table holds T_ver
curves for the model and GPU it runs as "decode" (:func:`with_applicable_rule`), unless ``budget_table`` is
``"measured"`` (``budget_table.MeasuredBudgets``): then the rule prices every size at T_ver 0 and its step clock
measures whole steps instead, from one node a request up.

Under async scheduling the scheduler fixes each request's next tree size before the step that drafts it runs
(``worker/scheduler.async_budget`` and ``async_quotas``). The rules "decode" and "throughput" apply there: for
"throughput" the scheduler asks the model runner's budget policy of its own engine (``worker/budget_policy.py``,
handed over by ``_vllm_compat.engine_link``; at tensor_parallel_size 1 vLLM runs the worker inside the engine
core), which holds the step clock and the acceptance model.
"""

import collections
import dataclasses
import functools
from pathlib import Path

from vllm.utils.math_utils import next_power_of_2

from ..logger import init_logger

from .budget_table import (MEASURED, MeasuredBudgets, default_budget, default_rule, default_table_path, device_name,
                           is_moe, model_fingerprint, read_table, select_model)

logger = init_logger(__name__)


def table_path(bole_config) -> Path:
    return Path(bole_config.budget_table) if bole_config.budget_table else default_table_path()


@functools.cache
def _auto_budgets(path: Path, fingerprint: str | None, moe: bool = False):
    """The table's budgets for this GPU and model, or None (after one warning naming the rule used instead)."""
    try:
        entries = read_table(path)
    except FileNotFoundError:
        reason = f"no calibration table at {path} (write one with `vllm-bole calibrate`)"
    except (OSError, ValueError) as e:
        reason = f"unreadable calibration table ({e})"
    else:
        budgets, reason = select_model(entries, device_name(), fingerprint)
        if budgets is not None:
            logger.info("Bole budget 'auto': %s for %s on %s, batch sizes %s", path, budgets.fingerprint,
                        budgets.gpu, budgets.batch_sizes)
            return budgets
        reason = f"{path}: {reason}"
    logger.warning("Bole budget 'auto': %s; using %s", reason, default_rule(moe))
    return None


def reload_budget_tables() -> None:
    """Forget the tables read so far (after writing one in this process)."""
    _auto_budgets.cache_clear()
    _measured_budgets.cache_clear()


def _budgets(bole_config, model_config):
    moe = is_moe(model_config)
    if bole_config.budget_table == MEASURED:
        return _measured_budgets(bole_config.max_nodes_per_request, moe)
    fingerprint = model_fingerprint(model_config) if model_config is not None else None
    return _auto_budgets(table_path(bole_config), fingerprint, moe)


@functools.cache
def _measured_budgets(per_request: int, moe: bool = False) -> MeasuredBudgets:
    logger.info("Bole budget 'auto' without a calibration table (budget_table %r): the throughput rule measures "
                "each batch size's steps (%s, until it has measured them)", MEASURED, default_rule(moe))
    return MeasuredBudgets.for_requests(per_request, moe)


def auto_budgets(bole_config, model_config=None):
    """The calibration table's budgets (``ModelBudgets``) for this model and GPU under ``budget: "auto"``; None for a
    fixed budget or without a table for them."""
    return _budgets(bole_config, model_config) if bole_config.budget == "auto" else None


def node_budget(bole_config, batch_size: int, context_len: int | None = None, model_config=None,
                rest_ms: float | None = None, tokens=None, probe: int = 0, keep: int | None = None) -> int:
    """Nodes to verify this step. ``context_len``: the batch's mean context length, if known (picks the KV
    bucket); ``model_config``: vLLM's ModelConfig (picks the model; without it, the only model calibrated on
    this GPU); ``rest_ms``: the step's measured time besides its target forward (``budget_rule "step"`` and
    ``"throughput"``; for the latter also N -> that time, :meth:`StepClock.rest_model`); ``tokens``: N -> the
    step's expected tokens with N nodes (``"throughput"``); ``probe``: :meth:`StepClock.probe`; ``keep``: the
    budget this rule chose last at this batch size (``"throughput"``: :meth:`ModelBudgets.lookup_throughput`)."""
    if bole_config.budget != "auto":
        return int(bole_config.budget)
    budgets = _budgets(bole_config, model_config)
    if budgets is None:
        return default_budget(batch_size, is_moe(model_config))
    if bole_config.budget_rule == "step" and rest_ms is not None:
        return budgets.lookup_step(batch_size, context_len, rest_ms)
    if bole_config.budget_rule == "throughput" and rest_ms is not None and tokens is not None:
        return budgets.lookup_throughput(batch_size, context_len, rest_ms, tokens, probe, keep)
    return budgets.lookup(batch_size, context_len)


def with_applicable_rule(bole_config, model_config=None):
    """``bole_config``, with ``budget_rule "throughput"`` (the default with "auto") replaced by "decode" where it
    has nothing to choose from: no calibration table with T_ver curves for this model and GPU. The rule would give
    B_ver (or the default budget) every step anyway, after feeding a step clock and an acceptance model for
    nothing. The model runner and the async scheduler both hold what this returns."""
    if bole_config.budget != "auto" or bole_config.budget_rule != "throughput":
        return bole_config
    budgets = _budgets(bole_config, model_config)
    if budgets is not None and (budgets.curves or budgets.measured):
        return bole_config
    return dataclasses.replace(bole_config, budget_rule="decode")


# Synchronous scheduling: the runner's budget choice of a step, ``(batch size, nodes, by the throughput rule)``,
# travels to the scheduler's BudgetLog on the step's draft token ids.
BUDGET_ATTR = "bole_budget_choice"


class BudgetLog:
    """What set recent steps' node budgets, one INFO line every ``interval_s`` (vLLM's stats interval,
    ``VLLM_LOG_STATS_INTERVAL``) that had steps: how many, the share the throughput rule chose (the others took
    the calibrated B_ver, or a fixed budget), the nodes per request and the batch sizes. Online the rule needs
    measured steps of one batch size (:class:`StepClock`), so this says how often it was in charge. ``captures``:
    a callable giving (graphs captured, milliseconds capturing) so far; the line adds the interval's, which stall
    the steps that capture."""

    def __init__(self, interval_s: float | None = None, captures=None):
        self._captures = captures
        self._captures_since = captures() if captures is not None else (0, 0.0)
        if interval_s is None:
            import vllm.envs as vllm_envs

            interval_s = vllm_envs.VLLM_LOG_STATS_INTERVAL
        self.interval_s = interval_s
        self.totals = dict.fromkeys(("steps", "by_rule", "nodes", "requests"), 0)   # since the start
        self._since = dict(self.totals)   # the totals when the interval began
        self._start: float | None = None
        self._batches: tuple[int, int] | None = None   # the interval's smallest and largest batch

    def interval(self) -> dict:
        """The counts of the interval so far (the totals since it began)."""
        return {key: value - self._since[key] for key, value in self.totals.items()}

    def record(self, batch_size: int, nodes: int, by_rule: bool, now: float) -> str | None:
        """One step's budget: the tree nodes it gives the batch, ``by_rule`` whether the throughput rule chose
        it; returns the line it logged, if any."""
        if self._start is None:
            self._start = now
        for key, value in (("steps", 1), ("by_rule", int(by_rule)), ("nodes", nodes), ("requests", batch_size)):
            self.totals[key] += value
        lo, hi = self._batches or (batch_size, batch_size)
        self._batches = (min(lo, batch_size), max(hi, batch_size))
        if now - self._start < self.interval_s:
            return None
        c = self.interval()
        line = (f"Bole budget: {c['steps']} steps in the last {now - self._start:.1f} s, "
                f"{100 * c['by_rule'] / c['steps']:.0f}% chosen by the throughput rule; "
                f"{c['nodes'] / max(c['requests'], 1):.2f} nodes per request, "
                f"batch {self._batches[0]}-{self._batches[1]}")
        if self._captures is not None:
            now_captures = self._captures()
            count, ms = (a - b for a, b in zip(now_captures, self._captures_since))
            self._captures_since = now_captures
            if count:
                line += f"; {count} CUDA graphs captured ({ms:.0f} ms)"
        logger.info(line)
        self._start, self._since, self._batches = now, dict(self.totals), None
        return line


def verify_ms(bole_config, batch_size: int, nodes: int, context_len: int | None = None,
              model_config=None) -> float | None:
    """The calibrated target forward of a step verifying ``nodes`` nodes (None without a table)."""
    budgets = auto_budgets(bole_config, model_config)
    return None if budgets is None else budgets.t_ver_ms(batch_size, context_len, nodes)


@dataclasses.dataclass(frozen=True)
class RestModel:
    """:meth:`StepClock.rest_model`: nodes -> ms of a step's rest, rest = mean + slope * (nodes per request - their
    mean); ``reach``: the nodes per request its recent measurements cover (their weighted mean plus twice their
    spread; beyond it the line is an extrapolation)."""

    batch_size: int
    mean_nodes: float    # per request
    mean_ms: float
    slope: float         # ms per node per request, never negative
    reach: float

    def __call__(self, nodes: int) -> float:
        return max(self.mean_ms + self.slope * (nodes / max(self.batch_size, 1) - self.mean_nodes), 0.0)


class StepClock:
    """Per batch size (power-of-two buckets), the time a step spends besides its target forward: the measured
    step period minus the calibrated T_ver of the nodes it verified, over steps that verified trees only.

    :meth:`rest_ms` is its exponential average (``budget_rule "step"``). :meth:`rest_model` also weighs how it
    grows with the nodes per request (``"throughput"``): bigger trees take more drafter levels and a wider first
    pass, which a single average, measured at the current size, would charge to every size alike. It fits
    rest = a + b * nodes/request over the recent steps (least squares, exponentially weighted); while those
    steps hardly differ in size the slope is unknown and the model is flat (their weighted mean). A flat model
    favours the largest trees, whose rest was never measured, and the rule would keep choosing them: so while the
    slope is unknown or falls (bigger trees never cost less: a falling fit is noise), :meth:`probe` has a run of
    ``PROBE_RUN`` budgets of a bucket, every ``PROBE_EVERY`` budgets, taken one calibrated size smaller or larger
    (in turn), which spreads the sizes the fit sees.

    The host measures a period that may belong to a step or two before or after the one whose size it records
    with it: under async scheduling it runs ahead of the device and paces itself on waits for earlier steps. A
    lone step of another size would then lend its size to a neighbour's period (and its period to a neighbour's
    size) and the slope would vanish in the noise. So a period enters the fit only when the last ``STEADY``
    ticks saw one batch size and one size of trees (within ``STEADY_TOL`` nodes per request), and the probes come
    in runs that hold such periods."""

    ALPHA = 0.2         # the average's step
    FIT_ALPHA = 0.05    # the fit's: a longer memory, so that it spans the sizes the rule has tried
    MIN_SPREAD = 0.5    # nodes per request: a smaller standard deviation of the sizes leaves the slope unknown
    STEADY = 3          # ticks of one size in a row for a period to enter the fit (sizes up to 2 steps off)
    STEADY_TOL = 0.1    # nodes per request: sizes this close count as one (a tree short of its quota now and then)
    PROBE_RUN = 5       # budgets per probe: STEADY - 1 of them settle, the rest are measured
    PROBE_EVERY = 20    # budgets from the start of one probe to the next while the slope is unknown
    # A period whose rest exceeds STALL_FACTOR times the bucket's average plus STALL_MS is a stall (a Triton JIT,
    # a host pause, a capture the graph count missed): hundreds of ms that the fit's long memory would spread
    # over every later estimate, favouring whichever size it did not land on.
    # STALL_RUN such periods in a row are not stalls: the steps got that slow (the next one counts).
    STALL_FACTOR = 3.0
    STALL_MS = 20.0
    STALL_RUN = 3

    def __init__(self):
        self._rest: dict[int, float] = {}
        self._fit: dict[int, list[float]] = {}   # bucket -> weighted sums [w, x, y, xx, xy]
        self._last: tuple[float, int] | None = None   # (time, batch size) of the last tick
        self._sizes: collections.deque = collections.deque(maxlen=self.STEADY)   # (batch size, x) per tick
        self._probes: dict[int, int] = {}   # bucket -> budgets chosen while the slope was unknown
        self._runs: dict[int, tuple[int, int]] = {}   # bucket -> (offset, budgets left) of a probe run
        self._stalls: dict[int, int] = {}   # bucket -> stalls in a row
        self._stalls_left_out: collections.Counter = collections.Counter()   # bucket -> stalls, for reports

    def rest_ms(self, batch_size: int) -> float | None:
        return self._rest.get(next_power_of_2(batch_size))

    def _spread(self, sums) -> float:
        """The weighted variance of the fit's sizes (nodes per request)."""
        w, sx, _, sxx, _ = sums
        return sxx / w - (sx / w) ** 2

    def _steady(self) -> bool:
        """Whether the last ``STEADY`` ticks saw one batch size and tree sizes within ``STEADY_TOL`` per request."""
        sizes = self._sizes
        if len(sizes) < self.STEADY or None in sizes or len({b for b, _ in sizes}) > 1:
            return False
        xs = [x for _, x in sizes]
        return max(xs) - min(xs) <= self.STEADY_TOL

    def _slope(self, sums) -> float | None:
        """The fit's slope (ms per node per request); None while the sizes have not spread enough to show it."""
        w, sx, sy, _, sxy = sums
        var = self._spread(sums)
        return (sxy / w - (sx / w) * (sy / w)) / var if var >= self.MIN_SPREAD ** 2 else None

    def rest_model(self, batch_size: int) -> "RestModel | None":
        """nodes -> the rest of a step of ``batch_size`` requests verifying that many nodes, in ms (never below
        zero, never falling with more nodes); None before the bucket's first measurement."""
        key = next_power_of_2(batch_size)
        sums = self._fit.get(key)
        if sums is None:
            return None
        w, sx, sy, _, _ = sums
        reach = sx / w + 2 * max(self._spread(sums), 0.0) ** 0.5
        return RestModel(batch_size, sx / w, sy / w, max(self._slope(sums) or 0.0, 0.0), reach)

    def fit_summary(self, batch_size: int) -> dict | None:
        """The rest fit of ``batch_size``'s bucket, for reports: its weight (steady periods, faded), the sizes'
        mean and standard deviation (nodes per request), the mean rest, the slope (ms per node per request; None
        while the sizes have not spread enough to show it) and the stalls left out so far."""
        sums = self._fit.get(next_power_of_2(batch_size))
        if sums is None:
            return None
        w, sx, sy, _, _ = sums
        mx, my, var, slope = sx / w, sy / w, self._spread(sums), self._slope(sums)
        return {"weight": round(w, 2), "nodes_per_request": round(mx, 2), "spread": round(max(var, 0.0) ** 0.5, 2),
                "rest_ms": round(my, 3), "slope_ms": None if slope is None else round(slope, 3),
                "stalls": self._stalls_left_out[next_power_of_2(batch_size)]}

    def probe(self, batch_size: int) -> int:
        """Once per budget the rule chooses: -1 or +1 (the next smaller or larger calibrated size than the best)
        for ``PROBE_RUN`` choices in a row, starting every ``PROBE_EVERY``-th choice of a bucket whose slope is
        unknown or falls, else 0. A run once started is finished."""
        key = next_power_of_2(batch_size)
        run = self._runs.pop(key, None)
        if run is not None:
            offset, left = run
            if left > 1:
                self._runs[key] = (offset, left - 1)
            return offset
        sums = self._fit.get(key)
        slope = None if sums is None else self._slope(sums)
        if sums is None or (slope is not None and slope > -1e-9):   # a falling rest is noise: keep probing
            return 0
        gap = self.PROBE_EVERY - self.PROBE_RUN + 1   # choices counted here from one run's start to the next
        n = self._probes[key] = self._probes.get(key, 0) + 1
        if n % gap:
            return 0
        offset = -1 if (n // gap) % 2 else 1
        if self.PROBE_RUN > 1:
            self._runs[key] = (offset, self.PROBE_RUN - 1)
        return offset

    def tick(self, now: float, batch_size: int, tree_only: bool, t_ver_ms: float | None,
             nodes: int | None = None, captured: bool = False) -> None:
        """Once per step at the same point (the runner: when drafting starts). The period since the last tick is
        one step; it counts when the batch size did not change and the step verified trees alone (no prefill),
        whose calibrated target forward was ``t_ver_ms``; ``nodes``: how many tree nodes it verified (the fit's
        x; None leaves the fit out). ``captured``: a CUDA graph was captured in the period (an eager warm-up and
        a capture, tens of ms each, once per new step shape): not counted, or every new tree size would look
        slow, and the rule would keep to the sizes it has seen. A stall (``STALL_FACTOR``) is left out alike."""
        last, self._last = self._last, (now, batch_size)
        key = next_power_of_2(batch_size)
        old = self._rest.get(key)
        counted = not (last is None or last[1] != batch_size or not tree_only or t_ver_ms is None or captured)
        rest = max((now - last[0]) * 1e3 - t_ver_ms, 0.0) if counted else None
        stall = (rest is not None and old is not None and rest > self.STALL_FACTOR * old + self.STALL_MS
                 and self._stalls.get(key, 0) < self.STALL_RUN)
        self._stalls[key] = self._stalls.get(key, 0) + 1 if stall else 0
        self._stalls_left_out[key] += stall
        # A step with a prefill, a capture or a stall in it also keeps its neighbours' periods out of the fit.
        steady = tree_only and not captured and not stall and nodes is not None
        self._sizes.append((batch_size, nodes / max(batch_size, 1)) if steady else None)
        if rest is None or stall:
            return
        self._rest[key] = rest if old is None else old + self.ALPHA * (rest - old)
        if nodes is not None and self._steady():
            x = nodes / batch_size
            sums = self._fit.setdefault(key, [0.0] * 5)
            for i, v in enumerate((1.0, x, rest, x * x, x * rest)):
                sums[i] = (1 - self.FIT_ALPHA) * sums[i] + v
