"""Recomputes the tree rows of an attention forward with their ancestor mask (any paged KV layout)."""

import torch

from ..kernels.tree_attention.reference import tree_attention
from ..worker.forest_context import current_forest


def request_slots(block_table_row: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    return block_table_row[positions // block_size].long() * block_size + positions % block_size


def redo_tree_rows(paged_view, kv_cache, query, output, attn_metadata, num_heads, head_size, scale) -> None:
    """After a causal kernel ran (and wrote this step's K/V), overwrite the rows of the current forest whose
    ancestor set differs from the causal one. ``paged_view(kv_cache).get(slots) -> (k, v)`` reads the cache."""
    forest = current_forest()
    if attn_metadata is None or forest is None or not forest.attention_rows:
        return
    paged = paged_view(kv_cache)
    q = query.view(query.shape[0], num_heads, head_size)
    o = output.view(output.shape[0], num_heads, head_size)
    seq_lens = attn_metadata.seq_lens.tolist()
    for rows in forest.attention_rows:
        # Rows whose ancestors are exactly the earlier rows already got the right answer from the kernel.
        redo = rows.differs_from_causal().nonzero().flatten().tolist()
        if not redo:
            continue
        positions = torch.arange(seq_lens[rows.req_index], device=q.device)
        k, v = paged.get(request_slots(attn_metadata.block_table[rows.req_index], positions, paged.block_size))
        idx = torch.tensor(redo, device=q.device) + rows.row_start
        o[idx] = tree_attention(q[idx], k, v, rows.region_mask[redo].to(q.device), scale)
