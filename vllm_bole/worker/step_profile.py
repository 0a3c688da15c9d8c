"""Where a Bole engine step spends its time: ``VLLM_BOLE_PROFILE_STEPS=N`` logs the mean time of each phase
(inputs + target forward, tree walk, commit + compaction, drafting) every N verification steps, and the mean
wall time from one step's end to the next's ("step": the phases plus scheduling and vLLM's own bookkeeping).

Each phase is closed by a device synchronize, so profiled runs are slower than plain ones; use it to compare
phases, and benchmarks (without it) for throughput.
"""

import contextlib
import time
from collections import defaultdict

import torch
from vllm.v1.utils import record_function_or_nullcontext

from .. import envs
from ..logger import init_logger

logger = init_logger(__name__)


class StepProfiler:
    def __init__(self, every: int):
        self.every = every
        self.total: dict[str, float] = defaultdict(float)
        self.current: dict[str, float] = defaultdict(float)
        self.steps = 0
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

    def means(self) -> dict[str, float]:
        """Mean ms per tree step of each phase over the steps not yet logged."""
        pending = self.steps % self.every
        return {k: v * 1e3 / pending for k, v in self.total.items()} if pending else {}

    def end_step(self, tree_step: bool) -> None:
        """Count a step (only steps that verified trees are reported) and log every ``every`` of them."""
        current, self.current = self.current, defaultdict(float)
        now, last, self._last_end = time.perf_counter(), self._last_end, time.perf_counter()
        if not tree_step:
            return
        # Wall time since the previous step ended: the phases plus what runs outside them (scheduling, output
        # processing, vLLM's own input preparation and bookkeeping).
        current["step"] = now - last if last is not None else sum(current.values())
        for k, v in current.items():
            self.total[k] += v
        self.steps += 1
        if self.steps % self.every == 0:
            phases = ", ".join(f"{k} {v * 1e3 / self.every:.2f} ms" for k, v in self.total.items())
            logger.info("Bole step profile (mean of %d tree steps): %s", self.every, phases)
            self.total.clear()


class SlowSteps:
    """``VLLM_BOLE_SLOW_STEP_MS=T``: a log line for every step that began more than T ms after the previous one
    began while a request ran in both (an engine waiting for arrivals is idle, not slow), naming what both ran
    (requests, tokens, prefill chunks, the path they took, graphs held). It adds no synchronize: the host waits
    where vLLM waits, so a stall on the device shows in the interval it blocks."""

    def __init__(self, threshold_ms: int):
        self.threshold_ms = threshold_ms
        self._last: tuple[float, frozenset, str] | None = None

    @classmethod
    def from_env(cls) -> "SlowSteps | None":
        ms = envs.VLLM_BOLE_SLOW_STEP_MS
        return cls(ms) if ms > 0 else None

    def begin(self, req_ids, facts: str) -> None:
        """A step of requests ``req_ids`` begins that runs ``facts``; logs the interval since the last one began
        if it is slow."""
        now, req_ids = time.perf_counter(), frozenset(req_ids)
        if self._last is not None:
            since, previous, previous_facts = self._last
            if (now - since) * 1e3 > self.threshold_ms and previous & req_ids:
                logger.warning("Bole slow step: %.0f ms since the previous step began (previous: %s; this: %s)",
                               (now - since) * 1e3, previous_facts, facts)
        self._last = (now, req_ids, facts)


@contextlib.contextmanager
def profiled(profiler: "StepProfiler | None", name: str):
    """``profiler.phase(name)`` (when the step profiler is on), inside vLLM's profiling scope ``bole: <name>``
    (a torch.profiler range when ``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1``, as vLLM's own runner phases)."""
    with record_function_or_nullcontext(f"bole: {name}"):
        with profiler.phase(name) if profiler is not None else contextlib.nullcontext():
            yield
