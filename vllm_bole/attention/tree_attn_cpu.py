"""CPU attention backend that runs tree nodes with an ancestor mask (vLLM's CPU_ATTN underneath).

vLLM's CPU kernel writes the step's K/V and computes causal attention for every row; rows that belong to a
tree are then recomputed with :func:`vllm_bole.kernels.tree_attention.reference.tree_attention` over the
request's prefix plus the node's ancestors, read back from the paged cache. The read-back needs the plain
"vec" cache layout (per block and KV head: K as [head_size, block_size], V as [block_size, head_size]), so on
CPUs where vLLM would pick its AMX kernel (bf16, block sizes divisible by 32) the builder and the layers run the
"vec" kernel instead: both choose the ISA independently, and the cache layout and the scheduler metadata must
agree.
"""

import torch
from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend, CPUAttentionBackendImpl,
                                                 CPUAttentionMetadataBuilder)

from .tree_rows import redo_tree_rows

_PLAIN_LAYOUT_ISAS = ("vec", "vec16")


def plain_layout_isa(isa: str) -> str:
    """The ISA Bole runs in place of vLLM's choice: AMX's blocked cache layout becomes the plain "vec" one."""
    return "vec" if isa == "amx" else isa


class CPUPagedKV:
    """Slot-indexed view of one CPU_ATTN layer cache ``[num_blocks, kv_heads, block_size, 2 * head_size]``."""

    def __init__(self, kv_cache: torch.Tensor):
        nb, h, bs, two_d = kv_cache.shape
        d = two_d // 2
        raw = kv_cache.view(nb, h, 2, bs * d)
        self.k = raw[:, :, 0].view(nb, h, d, bs)
        self.v = raw[:, :, 1].view(nb, h, bs, d)
        self.block_size = bs

    def get(self, slots: torch.Tensor):
        b, o = slots // self.block_size, slots % self.block_size
        return self.k[b, :, :, o], self.v[b, :, o]          # [n, h, d] each

    def set(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        b, o = slots // self.block_size, slots % self.block_size
        self.k[b, :, :, o] = k
        self.v[b, :, o] = v


class BoleCPUAttentionImpl(CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.isa = plain_layout_isa(self.isa)
        if self.isa not in _PLAIN_LAYOUT_ISAS:
            raise RuntimeError(
                f"Bole's CPU tree attention needs vLLM's 'vec' CPU attention kernel; this CPU selects "
                f"{self.isa!r}. Run Bole on an x86 CPU or on a GPU.")

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        redo_tree_rows(CPUPagedKV, kv_cache, query, output, attn_metadata, self.num_heads, self.head_size,
                       self.scale)
        return out


class BoleCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.isa = plain_layout_isa(self.isa)


class BoleCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return BoleCPUAttentionImpl

    @staticmethod
    def get_builder_cls():
        return BoleCPUAttentionMetadataBuilder
