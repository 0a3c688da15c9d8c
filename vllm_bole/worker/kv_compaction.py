"""After acceptance, move each request's accepted path K/V from its tree nodes' slots to contiguous slots.

Tree node j of a request was written to the slot of position prefix + j; the accepted path
``[0, a1, ..., aL]`` must end up at positions prefix .. prefix + L, i.e. the slots of nodes 0..L. Every
attention layer of every attention KV-cache group moves (the target's and the MTP drafter's): on a GPU in one
Triton launch for all layers whose caches share shape, dtype and strides; on CPU per layer with the torch
reference on vLLM's CPU cache layout.
"""

import torch
from vllm.platforms import current_platform
from vllm.utils.torch_utils import async_tensor_h2d
from vllm.v1.kv_cache_interface import AttentionSpec

from ..kernels.tree_attention.reference import compact_kv
from ..kernels.tree_attention import triton_tree_attn


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
    idx = async_tensor_h2d(src + dst, slot_mapping.device, torch.long)   # pinned (queued after the drafter)
    slots = slot_mapping[idx].long()
    return slots[:len(src)], slots[len(src):]


def walked_row_moves(walk, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The moves of a device walk (``spec_decode.device_walk.DeviceWalk``; ``starts``: ``[B]`` first row of each
    tree), on the device: ``[B * W]`` source and destination rows in path order, -1 where nothing moves."""
    col = torch.arange(walk.rows.shape[1], device=walk.rows.device)
    dst = starts.long()[:, None] + col[None, :]
    moves = (walk.rows >= 0) & (walk.rows != dst)
    return torch.where(moves, walk.rows, -1).flatten(), torch.where(moves, dst, -1).flatten()


def compact_layers(kv_caches, src_slots, dst_slots, walk=None, starts=None) -> None:
    """GPU: move ``src_slots[i] -> dst_slots[i]`` in each layer's FlashAttention cache, one launch per cache
    layout; layers that share one slot tensor (one KV-cache group) share it in the launch too. With ``walk`` (a
    device walk; ``starts``: each tree's first row) the slot tensors are the layers' slot mappings and the kernel
    reads the walk's moves itself."""
    by_layout = {}
    for entry in zip(kv_caches, src_slots, dst_slots):
        by_layout.setdefault((tuple(entry[0].shape), entry[0].stride(), entry[0].dtype), []).append(entry)
    for entries in by_layout.values():
        caches, src, dst = zip(*entries)
        shared = all(s is src[0] for s in src)
        if walk is not None:
            slots = src[0] if shared else torch.stack(src)
            triton_tree_attn.compact_walked_kv_paged(caches, walk.rows, starts, slots)
        elif shared:
            triton_tree_attn.compact_kv_paged(caches, src[0], dst[0])
        else:
            triton_tree_attn.compact_kv_paged(caches, torch.stack(src), torch.stack(dst))


def attention_groups(runner, skip=(), only=None):
    """(slot mapping, layer names) of each attention KV-cache group, its layers but those named in ``skip`` (of
    those named in ``only``, if given); groups left without layers are left out."""
    for gid, group in enumerate(runner.kv_cache_config.kv_cache_groups):
        if not isinstance(group.kv_cache_spec, AttentionSpec):
            continue
        names = [name for name in group.layer_names if name not in skip and (only is None or name in only)]
        if names:
            yield runner.input_batch.block_table[gid].slot_mapping.gpu, names


def compact_accepted_kv(runner, forest, skip=(), only=None, walk=None, starts=None) -> None:
    """Moves the accepted K/V of every attention layer but those named in ``skip`` (of those named in ``only``,
    if given). ``walk``: the step's device walk of the forest's trees, rows by token row, whose paths the host does
    not know yet (``starts``: each tree's first token row, if the trees are not all the step's rows); else the
    forest's host paths."""
    gpu = not current_platform.is_cpu()
    if walk is not None and starts is None:
        starts = forest.cu_seqlens[:-1]
    if walk is None:
        rows = accepted_row_moves(forest)
        if not rows[0]:
            return
    elif not gpu:
        src_rows, dst_rows = walked_row_moves(walk, starts)
    layers = runner.compilation_config.static_forward_context
    caches, src, dst = [], [], []
    for slot_mapping, names in attention_groups(runner, skip, only):
        if walk is not None and gpu:   # the kernel reads the walk's rows and this slot mapping itself
            s = d = slot_mapping
        elif walk is None:
            s, d = accepted_slot_moves(forest, slot_mapping, rows)
        else:   # -1 stays -1: the kernel skips it
            s = torch.where(src_rows >= 0, slot_mapping[src_rows.clamp(min=0)].long(), -1)
            d = torch.where(dst_rows >= 0, slot_mapping[dst_rows.clamp(min=0)].long(), -1)
        for name in names:
            caches.append(layers[name].kv_cache)
            src.append(s)
            dst.append(d)
    if not gpu:
        from ..attention.tree_attn_cpu import CPUPagedKV

        for cache, s, d in zip(caches, src, dst):
            keep = s >= 0
            compact_kv(CPUPagedKV(cache), s[keep], d[keep])
        return
    compact_layers(caches, src, dst, walk=walk, starts=starts)
