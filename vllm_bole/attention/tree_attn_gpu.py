"""GPU attention backend that runs tree nodes with an ancestor mask (vLLM's FlashAttention underneath).

FlashAttention computes every row causally and writes the step's K/V; tree rows are then recomputed with the
torch reference over the request's prefix plus the node's ancestors. Correct, not fast: the fast prefix pass
+ tree block kernel replaces this recomputation.
"""

import torch
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl

from ..kernels.tree_attention.reference import tree_attention
from ..worker.forest_context import current_forest
from .tree_attn_cpu import request_slots


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
        forest = current_forest()
        if attn_metadata is None or forest is None or not forest.attention_rows:
            return out
        paged = NHDPagedKV(kv_cache)
        q = query.view(query.shape[0], self.num_heads, self.head_size)
        o = output.view(output.shape[0], self.num_heads, self.head_size)
        seq_lens = attn_metadata.seq_lens.tolist()
        for rows in forest.attention_rows:
            n_rows = rows.region_mask.shape[0]
            positions = torch.arange(seq_lens[rows.req_index], device=q.device)
            slots = request_slots(attn_metadata.block_table[rows.req_index], positions, paged.block_size)
            k, v = paged.get(slots)
            o[rows.row_start:rows.row_start + n_rows] = tree_attention(
                q[rows.row_start:rows.row_start + n_rows], k, v, rows.region_mask.to(q.device), self.scale)
        return out


class BoleFlashAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return BoleFlashAttentionImpl
