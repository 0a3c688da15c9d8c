"""Recomputes the tree rows of a causal attention forward with their ancestor mask (CPU backend, any paged KV
layout)."""

from ..kernels.tree_attention.reference import paged_tree_attention
from ..step.forest import current_forest


def redo_tree_rows(paged_view, kv_cache, query, output, attn_metadata, num_heads, head_size, scale) -> None:
    """After a causal kernel ran (and wrote this step's K/V), overwrite the rows of the current forest whose
    ancestor set differs from the causal one. ``paged_view(kv_cache)`` is the cache's slot view."""
    forest = current_forest()
    if attn_metadata is None or forest is None or not forest.has_tree_rows:
        return
    q = query.view(query.shape[0], num_heads, head_size)
    o = output.view(output.shape[0], num_heads, head_size)
    paged_tree_attention(paged_view(kv_cache), q, o, attn_metadata.seq_lens.tolist(), attn_metadata.block_table,
                         forest.rows(), scale, non_causal_only=True)
