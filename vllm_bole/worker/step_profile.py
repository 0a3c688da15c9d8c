"""Where a Bole engine step spends its time: ``VLLM_BOLE_PROFILE_STEPS=N`` logs the mean time of each phase
(inputs + target forward, tree walk, commit + compaction, drafting) every N verification steps of a kind (only
trees, or trees beside prefill chunks), and the mean wall time from one step's end to the next's ("step": the
phases plus scheduling and vLLM's own bookkeeping).

Each phase is closed by a device synchronize, so profiled runs are slower than plain ones; use it to compare
phases, and benchmarks (without it) for throughput. ``VLLM_BOLE_SLOW_STEP_MS=T`` times whole steps without a
synchronize instead (:class:`StepTimes`): slow steps, and every step by its kind.
"""

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
from vllm.v1.utils import record_function_or_nullcontext

from .. import envs
from ..logger import init_logger

logger = init_logger(__name__)


# The steps the profiler reports, by kind: (key, its name in the log line).
PROFILED_KINDS = (("trees", "tree-only"), ("mixed", "mixed (trees beside prefill chunks)"))


class StepProfiler:
    def __init__(self, every: int):
        self.every = every
        self.total: dict[str, dict[str, float]] = {kind: defaultdict(float) for kind, _ in PROFILED_KINDS}
        self.steps: dict[str, int] = dict.fromkeys(self.total, 0)
        self.current: dict[str, float] = defaultdict(float)
        self._last_end: float | None = None

    @classmethod
    def from_env(cls) -> "StepProfiler | None":
        every = envs.VLLM_BOLE_PROFILE_STEPS
        return cls(every) if every > 0 else None

    @staticmethod
    def _sync():
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def phase(self, name: str):
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.current[name] += time.perf_counter() - start

    def means(self, kind: str = "trees") -> dict[str, float]:
        """Mean ms per step of ``kind`` of each phase over the steps not yet logged."""
        pending = self.steps[kind] % self.every
        return {k: v * 1e3 / pending for k, v in self.total[kind].items()} if pending else {}

    def end_step(self, kind: str | None) -> None:
        """Count a step of ``kind`` ("trees": only trees, "mixed": trees beside prefill chunks; None: a step
        without trees, which is not reported) and log every ``every`` steps of a kind."""
        current, self.current = self.current, defaultdict(float)
        now, last, self._last_end = time.perf_counter(), self._last_end, time.perf_counter()
        if kind is None:
            return
        # Wall time since the previous step ended: the phases plus what runs outside them (scheduling, output
        # processing, vLLM's own input preparation and bookkeeping).
        current["step"] = now - last if last is not None else sum(current.values())
        total = self.total[kind]
        for k, v in current.items():
            total[k] += v
        self.steps[kind] += 1
        if self.steps[kind] % self.every == 0:
            phases = ", ".join(f"{k} {v * 1e3 / self.every:.2f} ms" for k, v in total.items())
            logger.info("Bole step profile (mean of %d %s steps): %s", self.every, dict(PROFILED_KINDS)[kind],
                        phases)
            total.clear()


@dataclass(frozen=True)
class StepFacts:
    """What an engine step runs, as the runner schedules it, and the runner's counters when it begins (their
    change by the next step tells the path the step took)."""

    requests: int
    tokens: int
    prefilling: int          # requests with more tokens than their drafts and root (prefill chunks)
    trees: int               # requests verifying drafts
    early_drafted: int       # early-drafted steps so far
    verify_graphs: int       # verification CUDA graphs held
    drafter_graphs: int      # drafter CUDA graphs held

    def __str__(self) -> str:
        return (f"{self.requests} requests, {self.tokens} tokens, {self.prefilling} prefilling; so far "
                f"{self.early_drafted} early-drafted steps, graphs {self.verify_graphs} verify / "
                f"{self.drafter_graphs} drafter")

    def kind(self, after: "StepFacts") -> str:
        """The kind of this step, given the facts of the step after it: ``capturing`` (it captured a CUDA graph),
        ``trees_early`` / ``trees_late`` (only trees, drafted before / after the host walk), ``mixed_early`` /
        ``mixed_late`` (trees beside prefill chunks, likewise), ``prefill`` or ``decode`` (no trees)."""
        if (after.verify_graphs, after.drafter_graphs) != (self.verify_graphs, self.drafter_graphs):
            return "capturing"
        if self.trees:
            when = "early" if after.early_drafted > self.early_drafted else "late"
            return f"mixed_{when}" if self.prefilling else f"trees_{when}"
        return "prefill" if self.prefilling else "decode"


# The order of the kinds in the summary line.
STEP_KINDS = ("trees_early", "trees_late", "mixed_early", "mixed_late", "prefill", "decode", "capturing")


class StepTimes:
    """``VLLM_BOLE_SLOW_STEP_MS=T``: how long each engine step took from its start to the next step's start,
    counted only while a request ran in both (an engine waiting for arrivals is idle, not slow).

    - A warning for every step past T ms, naming what it and the step after it ran (:class:`StepFacts`).
    - A summary by kind of step (:meth:`StepFacts.kind`: steps, mean and longest ms, mean scheduled tokens) every
      ``SUMMARY_EVERY_S`` seconds and when the engine turns idle (logged at the first step after the gap), so
      that a workload's steps can be told apart: early-drafted trees, mixed steps, captures.

    It adds no synchronize: the host waits where vLLM waits, so a stall on the device shows in the interval it
    blocks (under async scheduling, one step late)."""

    SUMMARY_EVERY_S = 10.0   # as vLLM's stats lines

    def __init__(self, threshold_ms: int):
        self.threshold_ms = threshold_ms
        self._last: tuple[float, frozenset, StepFacts] | None = None
        self._kinds: dict[str, list[float]] = {}   # kind -> [steps, total ms, longest ms, scheduled tokens]
        self._since: float | None = None

    @classmethod
    def from_env(cls) -> "StepTimes | None":
        ms = envs.VLLM_BOLE_SLOW_STEP_MS
        return cls(ms) if ms > 0 else None

    def begin(self, req_ids, facts: StepFacts) -> None:
        """A step of requests ``req_ids`` begins that runs ``facts``; times the step before it."""
        now, req_ids = time.perf_counter(), frozenset(req_ids)
        if self._last is not None:
            since, previous, previous_facts = self._last
            ms, busy = (now - since) * 1e3, bool(previous & req_ids)
            if busy:
                if ms > self.threshold_ms:
                    logger.warning("Bole slow step: %.0f ms since the previous step began (previous: %s; this: %s)",
                                   ms, previous_facts, facts)
                counts = self._kinds.setdefault(previous_facts.kind(facts), [0, 0.0, 0.0, 0])
                counts[0] += 1
                counts[1] += ms
                counts[2] = max(counts[2], ms)
                counts[3] += previous_facts.tokens
                if self._since is None:
                    self._since = since
            if self._kinds and (not busy or now - self._since >= self.SUMMARY_EVERY_S):
                self.log_summary()
        self._last = (now, req_ids, facts)

    def log_summary(self) -> None:
        """Logs the steps timed since the last summary, by kind, and starts a new one."""
        kinds, self._kinds, self._since = self._kinds, {}, None
        if not kinds:
            return
        parts = [f"{k} {int(n)} steps, mean {ms / n:.1f} ms, max {longest:.0f} ms, {tokens / n:.0f} tokens"
                 for k in STEP_KINDS if k in kinds for n, ms, longest, tokens in [kinds[k]]]
        logger.info("Bole step times: %s", "; ".join(parts))

    def reset(self) -> None:
        """Forgets every step so far (after the start-up warm-up)."""
        self._last, self._kinds, self._since = None, {}, None


@contextlib.contextmanager
def profiled(profiler: "StepProfiler | None", name: str):
    """``profiler.phase(name)`` (when the step profiler is on), inside vLLM's profiling scope ``bole: <name>``
    (a torch.profiler range when ``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1``, as vLLM's own runner phases)."""
    with record_function_or_nullcontext(f"bole: {name}"):
        with profiler.phase(name) if profiler is not None else contextlib.nullcontext():
            yield
