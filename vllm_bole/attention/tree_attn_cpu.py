"""CPU attention backend that runs tree nodes with an ancestor mask (vLLM's CPU_ATTN underneath).

vLLM's CPU kernel writes the step's K/V and computes causal attention for every row; rows that belong to a
tree are then recomputed with :func:`vllm_bole.kernels.tree_attention.reference.tree_attention` over the
request's prefix plus the node's ancestors, read back from the paged cache. The read-back needs the plain
"vec" cache layout (per block and KV head: K as [head_size, block_size], V as [block_size, head_size]).
"""

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from ..kernels.tree_attention.reference import tree_attention
from ..worker.forest_context import current_forest

_PLAIN_LAYOUT_ISAS = ("vec", "vec16")


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


def request_slots(block_table_row: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    return block_table_row[positions // block_size].long() * block_size + positions % block_size


class BoleCPUAttentionImpl(CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.isa not in _PLAIN_LAYOUT_ISAS:
            raise RuntimeError(
                f"Bole's CPU tree attention needs vLLM's 'vec' CPU attention kernel; this CPU selects "
                f"{self.isa!r}. Run Bole on a CPU without AMX, or on a GPU.")

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        out = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        forest = current_forest()
        if attn_metadata is None or forest is None or not forest.attention_rows:
            return out
        paged = CPUPagedKV(kv_cache)
        q = query.view(query.shape[0], self.num_heads, self.head_size)
        o = output.view(output.shape[0], self.num_heads, self.head_size)
        seq_lens = attn_metadata.seq_lens.tolist()
        for rows in forest.attention_rows:
            n_rows = rows.region_mask.shape[0]
            positions = torch.arange(seq_lens[rows.req_index])
            slots = request_slots(attn_metadata.block_table[rows.req_index], positions, paged.block_size)
            k, v = paged.get(slots)
            o[rows.row_start:rows.row_start + n_rows] = tree_attention(
                q[rows.row_start:rows.row_start + n_rows], k, v, rows.region_mask, self.scale)
        return out


class BoleCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return BoleCPUAttentionImpl
