import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton creates its language helpers (tl.cdiv, ...) for the interpreter only when TRITON_INTERPRET is set
    # at its first import; the kernel tests interpret, and vLLM (imported by other test modules, possibly
    # first) imports Triton too. Import it here for the interpreter, without leaving the variable set for
    # vLLM or the engines that tests start.
    _old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.language  # noqa: F401

    if _old is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _old

    # vLLM's CPU sampler is torch.compile'd at import; the first compile in a process probes the CPU's vector
    # ISAs by starting ten Python subprocesses, about 22 s of every engine start here. The tests' engines
    # (subprocesses inherit this) and in-process samplers run the same functions eagerly instead.
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


@pytest.fixture(scope="session")
def tiny_qwen3_5_dir() -> str:
    """Cached tiny Qwen3.5 checkpoint (in ``$VLLM_BOLE_CACHE``, else ``tests/.cache``)."""
    from vllm_bole import envs
    from vllm_bole.testing import tiny_model_dir

    cache = envs.VLLM_BOLE_CACHE or Path(__file__).parent / ".cache"
    return tiny_model_dir("qwen3_5", cache_dir=cache)


def pytest_collection_modifyitems(config, items):
    """Modules without an engine (kernels, references, config, units) run before the modules that build vLLM
    engines (marker ``vllm``), so that a broken reference fails within minutes; the order within each tier and
    each module stays as collected, so module fixtures are built once."""
    engine_modules = {item.module for item in items if item.get_closest_marker("vllm")}
    items.sort(key=lambda item: item.module in engine_modules)
