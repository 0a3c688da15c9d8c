"""Where a Bole engine step spends its time: ``VLLM_BOLE_PROFILE_STEPS=N`` logs the mean time of each phase
(inputs + target forward, tree walk, commit + compaction, drafting) every N verification steps.

Each phase is closed by a device synchronize, so profiled runs are slower than plain ones; use it to compare
phases, and benchmarks (without it) for throughput.
"""

import contextlib
import os
import time
from collections import defaultdict

import torch
from ..logger import init_logger

logger = init_logger(__name__)


class StepProfiler:
    def __init__(self, every: int):
        self.every = every
        self.total: dict[str, float] = defaultdict(float)
        self.current: dict[str, float] = defaultdict(float)
        self.steps = 0

    @classmethod
    def from_env(cls) -> "StepProfiler | None":
        every = int(os.environ.get("VLLM_BOLE_PROFILE_STEPS", "0"))
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

    def end_step(self, tree_step: bool) -> None:
        """Count a step (only steps that verified trees are reported) and log every ``every`` of them."""
        current, self.current = self.current, defaultdict(float)
        if not tree_step:
            return
        for k, v in current.items():
            self.total[k] += v
        self.steps += 1
        if self.steps % self.every == 0:
            phases = ", ".join(f"{k} {v * 1e3 / self.every:.2f} ms" for k, v in self.total.items())
            logger.info("Bole step profile (mean of %d tree steps): %s", self.every, phases)
            self.total.clear()


def profiled(profiler: "StepProfiler | None", name: str):
    """``profiler.phase(name)``, or nothing when profiling is off."""
    return profiler.phase(name) if profiler is not None else contextlib.nullcontext()
