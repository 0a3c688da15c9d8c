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


def accepted_slot_moves(forest, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(source slots, destination slots) of every accepted non-root node whose slot changes."""
    src, dst = [], []
    for i, path in enumerate(forest.accepted_paths):
        base = forest.query_starts[i]
        for j, node in enumerate(path):
            if node != j:
                src.append(base + node)
                dst.append(base + j)
    rows_src = torch.tensor(src, dtype=torch.long, device=slot_mapping.device)
    rows_dst = torch.tensor(dst, dtype=torch.long, device=slot_mapping.device)
    return slot_mapping[rows_src].long(), slot_mapping[rows_dst].long()


def compact_accepted_kv(runner, forest) -> None:
    if not any(any(n != j for j, n in enumerate(p)) for p in forest.accepted_paths):
        return
    layers = runner.compilation_config.static_forward_context
    for gid, group in enumerate(runner.kv_cache_config.kv_cache_groups):
        if not isinstance(group.kv_cache_spec, AttentionSpec):
            continue
        total = forest.query_starts[-1] + len(forest.tokens[-1])
        src, dst = accepted_slot_moves(forest, runner.input_batch.block_table[gid].slot_mapping.gpu[:total])
        for name in group.layer_names:
            compact_kv(paged_kv(layers[name].kv_cache), src, dst)
