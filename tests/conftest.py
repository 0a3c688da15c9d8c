import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_qwen3_5_dir() -> str:
    """Cached tiny Qwen3.5 checkpoint (in ``$VLLM_BOLE_CACHE``, else ``tests/.cache``)."""
    from vllm_bole.testing import tiny_model_dir

    cache = os.environ.get("VLLM_BOLE_CACHE") or Path(__file__).parent / ".cache"
    return tiny_model_dir("qwen3_5", cache_dir=cache)
