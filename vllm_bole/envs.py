"""Every environment variable Bole reads, declared here once, as ``vllm.envs`` declares vLLM's: read
``vllm_bole.envs.NAME``, which parses the variable at that moment (a bad value is a one-line error naming it).
docs/configuration.md says what each one does."""

import os
from collections.abc import Callable
from typing import Any


def _positive_int(name: str, default: str) -> int:
    value = os.environ.get(name, default)
    if not value.strip().isdigit() or int(value) < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _optional_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    if not value.strip().lstrip("-").isdigit():
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _non_negative_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    if not value.strip().isdigit():
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return int(value)


environment_variables: dict[str, Callable[[], Any]] = {
    # Calibration table that budget "auto" reads when speculative_config.budget_table is not given.
    "VLLM_BOLE_BUDGET_TABLE": lambda: os.environ.get("VLLM_BOLE_BUDGET_TABLE") or None,
    # Folder of the default calibration table and the tiny test models (None: ~/.cache/vllm-bole).
    "VLLM_BOLE_CACHE": lambda: os.environ.get("VLLM_BOLE_CACHE") or None,
    # Occurrences of a new step or drafter-level shape before it gets its own CUDA graph (1: at once).
    "VLLM_BOLE_CAPTURE_AFTER": lambda: _positive_int("VLLM_BOLE_CAPTURE_AFTER", "3"),
    # Log each phase's mean time every N verification steps (0: off).
    "VLLM_BOLE_PROFILE_STEPS": lambda: int(os.environ.get("VLLM_BOLE_PROFILE_STEPS", "0") or 0),
    # Log every engine step whose wall time from the previous step's start exceeds this many ms, with what it ran
    # (0: off). No synchronizes: under async scheduling a step's time shows in the step after it.
    "VLLM_BOLE_SLOW_STEP_MS": lambda: int(os.environ.get("VLLM_BOLE_SLOW_STEP_MS", "0") or 0),
    # The model runner keeps every verified tree and its walk (vllm-bole acceptance-profile reads them).
    "VLLM_BOLE_RECORD_WALKS": lambda: os.environ.get("VLLM_BOLE_RECORD_WALKS", "0") == "1",
    # "reference": the torch references on CUDA too (bisecting a kernel mismatch); else "triton".
    "VLLM_BOLE_KERNELS": lambda: os.environ.get("VLLM_BOLE_KERNELS", "triton"),
    # One threshold on the longest sequence for the tree-attention route (None: the measured rule).
    "VLLM_BOLE_INLINE_PREFIX_MAX_SEQ": lambda: _optional_int("VLLM_BOLE_INLINE_PREFIX_MAX_SEQ"),
    # The most nodes per request a step drafts as a one-wide chain (0: never; unset: where the acceptance
    # model's best-first tree is a chain, BudgetPolicy.width).
    "VLLM_BOLE_CHAIN_NODES": lambda: _non_negative_int("VLLM_BOLE_CHAIN_NODES"),
    # The MTP drafter grows its tree levels with host bookkeeping instead of on the device.
    "VLLM_BOLE_HOST_DRAFT_LEVELS": lambda: os.environ.get("VLLM_BOLE_HOST_DRAFT_LEVELS", "0") == "1",
    # Tests: the tiny GPU engines run with torch.compile and CUDA graphs.
    "VLLM_BOLE_TEST_CUDA_GRAPHS": lambda: os.environ.get("VLLM_BOLE_TEST_CUDA_GRAPHS") == "1",
    # Tests: the GPU memory share of each tiny engine, so that several run side by side (None: vLLM's default).
    "VLLM_BOLE_TEST_GPU_SHARE": lambda: float(os.environ["VLLM_BOLE_TEST_GPU_SHARE"])
    if os.environ.get("VLLM_BOLE_TEST_GPU_SHARE") else None,
    # Tests: seconds a test's engine may run before the test fails with its log tail and thread stacks.
    "VLLM_BOLE_TEST_ENGINE_TIMEOUT": lambda: _non_negative_int("VLLM_BOLE_TEST_ENGINE_TIMEOUT") or 900,
    # Tests: a folder with copies of vLLM's FLA kernel files, for a GPU machine without vLLM.
    "BOLE_VLLM_FLA_DIR": lambda: os.environ.get("BOLE_VLLM_FLA_DIR") or None,
}


def __getattr__(name: str):
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return list(environment_variables)
