"""Bole's worker: the platform's V1 worker, building Bole's model runner and registering Bole's layers."""

import importlib

from vllm.platforms import current_platform

from .._vllm_compat import module_attr_override, pause_jit_monitor, resume_jit_monitor
from ..attention.registration import register_bole_layers
from ..logger import init_logger
from .model_runner import BoleModelRunnerMixin, bole_runner_class

if current_platform.is_cpu():
    from vllm.v1.worker.cpu_worker import CPUWorker as _PlatformWorker

    _RUNNER_MODULE, _RUNNER_NAME = "vllm.v1.worker.cpu_worker", "CPUModelRunner"
else:
    from vllm.v1.worker.gpu_worker import Worker as _PlatformWorker

    _RUNNER_MODULE, _RUNNER_NAME = "vllm.v1.worker.gpu_model_runner", "GPUModelRunner"

logger = init_logger(__name__)


class BoleWorker(_PlatformWorker):
    def init_device(self):
        register_bole_layers()
        base = getattr(importlib.import_module(_RUNNER_MODULE), _RUNNER_NAME)
        with module_attr_override(_RUNNER_MODULE, _RUNNER_NAME, bole_runner_class(base)):
            super().init_device()
        if not isinstance(self.model_runner, BoleModelRunnerMixin):
            raise RuntimeError(
                "speculative method 'bole' needs vLLM's V1 model runner; unset VLLM_USE_V2_MODEL_RUNNER")

    def bole_step_counts(self) -> dict:
        """The runner's step counters (``BoleModelRunnerMixin.step_counts``), for ``LLM.collective_rpc(
        "bole_step_counts")``: the only way to read them when the workers run in other processes (tensor
        parallelism)."""
        return self.model_runner.step_counts()

    def bole_graph_counts(self) -> tuple[int, int]:
        """The runner's (verification, drafter) CUDA graphs (``BoleModelRunnerMixin.bole_graph_counts``)."""
        return self.model_runner.bole_graph_counts()

    def bole_before_warmup(self) -> None:
        """The start-up warm-up begins (``worker/warmup.py``): its compilations are not reported as inference's."""
        self._bole_jit_monitor = pause_jit_monitor()

    def bole_warm_up_kernels(self) -> None:
        """The tree kernels' launch variants of eager steps (``worker/kernel_warmup.py``), on GPUs."""
        if not current_platform.is_cuda():
            return
        from .kernel_warmup import warm_up_kernels

        try:
            warm_up_kernels(self.model_runner)
        except Exception:   # serving compiles what is missing on first use, as without this part of the warm-up
            logger.exception("Bole warm-up: launching the tree kernels' variants failed; serving goes on")

    def bole_after_warmup(self) -> None:
        """The start-up warm-up is over: the JIT monitor reports again, and the runner forgets the traffic."""
        resume_jit_monitor(getattr(self, "_bole_jit_monitor", None))
        self._bole_jit_monitor = None
        self.model_runner.bole_after_warmup()
