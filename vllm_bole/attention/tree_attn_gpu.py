"""GPU attention backend that runs tree nodes with an ancestor mask (vLLM's FlashAttention underneath).

FlashAttention computes every row causally and writes the step's K/V; tree rows are then recomputed with the
torch reference over the request's prefix plus the node's ancestors. Correct, not fast: the fast prefix pass
+ tree block kernel replaces this recomputation.
"""

import torch
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl

from .tree_rows import redo_tree_rows


class NHDPagedKV:
    """Slot-indexed view of a FlashAttention cache, logical ``[num_blocks, kv_heads, block_size, 2 * head]``."""

    def __init__(self, kv_cache: torch.Tensor):
        d = kv_cache.shape[-1] // 2
        self.k, self.v = kv_cache[..., :d], kv_cache[..., d:]
        self.block_size = kv_cache.shape[2]

    def get(self, slots: torch.Tensor):
        b, o = slots // self.block_size, slots % self.block_size
        return self.k[b, :, o], self.v[b, :, o]

    def set(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        b, o = slots // self.block_size, slots % self.block_size
        self.k[b, :, o] = k
        self.v[b, :, o] = v


class BoleFlashAttentionImpl(FlashAttentionImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        redo_tree_rows(NHDPagedKV, kv_cache, query, output, attn_metadata, self.num_heads, self.head_size,
                       self.scale)
        return out


class BoleFlashAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return BoleFlashAttentionImpl
