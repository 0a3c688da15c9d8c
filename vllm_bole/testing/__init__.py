"""Test support: tiny offline Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoints for tests, demos and CI."""

__all__ = [
    "KINDS",
    "TinyShape",
    "WeightRecipe",
    "build_tiny_qwen3_5",
    "build_tiny_qwen3_5_moe",
    "build_tiny_qwen3_next",
    "engine_kwargs",
    "tiny_model_dir",
]


def __getattr__(name: str):
    # Lazy, so that `python -m vllm_bole.testing.tiny_models` does not import the module twice.
    if name in __all__:
        from vllm_bole.testing import tiny_models

        return getattr(tiny_models, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
