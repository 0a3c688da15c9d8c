"""Registers Bole's GDN layer and tree attention backend with vLLM's registries (worker processes only)."""

from vllm.platforms import current_platform
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

_DONE = False


def register_bole_layers() -> None:
    global _DONE
    if _DONE:
        return
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    from .gdn import BoleQwenGDN

    QwenGatedDeltaNetAttention.register_oot(BoleQwenGDN)
    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, "vllm_bole.attention.tree_attn_cpu.BoleCPUAttentionBackend")
    else:
        register_backend(AttentionBackendEnum.FLASH_ATTN,
                         "vllm_bole.attention.tree_attn_gpu.BoleFlashAttentionBackend")
    _DONE = True
