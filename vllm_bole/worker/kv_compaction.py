"""After acceptance, move each request's accepted path K/V from its tree nodes' slots to contiguous slots.

Tree node j of a request was written to the slot of position prefix + j; the accepted path
``[0, a1, ..., aL]`` must end up at positions prefix .. prefix + L, i.e. the slots of nodes 0..L.
"""

import torch
from vllm.platforms import current_platform
from vllm.v1.kv_cache_interface import AttentionSpec

from ..kernels.tree_attention.reference import compact_kv


def paged_kv(kv_cache: torch.Tensor):
    """Slot accessors (``get``/``set``) for one attention layer's cache on this platform."""
    if current_platform.is_cpu():
        from ..attention.tree_attn_cpu import CPUPagedKV

        return CPUPagedKV(kv_cache)
    from ..attention.tree_attn_gpu import NHDPagedKV

    return NHDPagedKV(kv_cache)


def accepted_row_moves(forest) -> tuple[list[int], list[int]]:
    """(source rows, destination rows) in the step's flat token arrays of every accepted node that moves."""
    src, dst = [], []
    for i, path in enumerate(forest.accepted_paths):
        base = forest.query_starts[i]
        for j, node in enumerate(path):
            if node != j:
                src.append(base + node)
                dst.append(base + j)
    return src, dst


def accepted_slot_moves(forest, slot_mapping: torch.Tensor, rows=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(source slots, destination slots) of those moves in one KV-cache group (``rows``: precomputed moves)."""
    src, dst = rows if rows is not None else accepted_row_moves(forest)
    idx = lambda r: torch.tensor(r, dtype=torch.long, device=slot_mapping.device)  # noqa: E731
    return slot_mapping[idx(src)].long(), slot_mapping[idx(dst)].long()


def compact_accepted_kv(runner, forest) -> None:
    rows = accepted_row_moves(forest)
    if not rows[0]:
        return
    layers = runner.compilation_config.static_forward_context
    for gid, group in enumerate(runner.kv_cache_config.kv_cache_groups):
        if not isinstance(group.kv_cache_spec, AttentionSpec):
            continue
        src, dst = accepted_slot_moves(forest, runner.input_batch.block_table[gid].slot_mapping.gpu, rows)
        for name in group.layer_names:
            compact_kv(paged_kv(layers[name].kv_cache), src, dst)
