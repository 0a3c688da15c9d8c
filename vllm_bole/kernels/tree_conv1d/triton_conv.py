"""Triton causal depthwise conv1d over a packed forest, and the conv-state commit.

A node's window is itself, its ancestors (nearest first), then its request's committed conv state, W taps in
all (see :mod:`.reference`). One program per (request, channel block) walks W-1 parent links per node tile;
the commit walks them once from the accepted node and writes every layer in one launch through a table of
per-layer base addresses and strides (vLLM's conv caches are strided per-layer views).
"""

import torch
import triton
import triton.language as tl

from ..launch import device_table, launch_plan


# Runs eagerly too: no variant per alignment of the per-step index tensors (scalar loads).
@triton.jit(do_not_specialize_on_alignment=["state_idx", "parent", "cu_seqlens"])
def _tree_conv_kernel(
    x, weight, bias, conv_state, state_idx, parent, cu_seqlens, out, x_copy,
    stride_x, stride_out, stride_x_copy, stride_w_d, stride_w_t, stride_s_b, stride_s_d, stride_s_t, DIM,
    W: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    HAS_IDX: tl.constexpr, COPY_X: tl.constexpr,
):
    b, pid_d = tl.program_id(0), tl.program_id(1)
    # The committed window is read in place from the request's cache slot (no gathered copy).
    slot = tl.load(state_idx + b).to(tl.int64) if HAS_IDX else b.to(tl.int64)
    bos = tl.load(cu_seqlens + b).to(tl.int64)
    t = tl.load(cu_seqlens + b + 1).to(tl.int64) - bos
    o_d = pid_d * BD + tl.arange(0, BD)
    md = o_d < DIM
    if HAS_BIAS:
        b_bias = tl.load(bias + o_d, mask=md, other=0.0).to(tl.float32)
    for start in range(0, t, BN):
        nodes = start + tl.arange(0, BN)
        mn = nodes < t
        cur = tl.where(mn, nodes, -1)
        used_state = tl.zeros([BN], dtype=tl.int32)  # committed entries consumed so far, per node
        acc = tl.zeros([BN, BD], dtype=tl.float32)
        for s in tl.static_range(W):
            # Tap s looks s steps back: an ancestor while the path lasts, then the committed state.
            on_path = cur >= 0
            from_x = tl.load(x + (bos + cur)[:, None] * stride_x + o_d[None, :],
                             mask=on_path[:, None] & md[None, :], other=0.0)
            if COPY_X and s == 0:   # tap 0 is the node's own input: keep it for the commit
                tl.store(x_copy + (bos + nodes)[:, None] * stride_x_copy + o_d[None, :], from_x,
                         mask=mn[:, None] & md[None, :])
            from_state = tl.load(conv_state + slot * stride_s_b + o_d[None, :] * stride_s_d
                                 + (W - 2 - used_state)[:, None] * stride_s_t,
                                 mask=(mn & ~on_path)[:, None] & md[None, :], other=0.0)
            w_s = tl.load(weight + o_d * stride_w_d + (W - 1 - s) * stride_w_t, mask=md, other=0.0)
            acc += tl.where(on_path[:, None], from_x.to(tl.float32), from_state.to(tl.float32)) \
                * w_s.to(tl.float32)[None, :]
            used_state += tl.where(on_path, 0, 1)
            cur = tl.load(parent + bos + cur, mask=on_path, other=-1)
        if HAS_BIAS:
            acc += b_bias[None, :]
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(out + (bos + nodes)[:, None] * stride_out + o_d[None, :], acc.to(out.dtype.element_ty),
                 mask=mn[:, None] & md[None, :])


def tree_causal_conv1d(x, weight, bias, conv_state, parent, cu_seqlens, activation="silu", *,
                       state_indices=None, x_copy=None):
    """Same contract as :func:`reference.tree_causal_conv1d`; weight may be ``[dim, W]`` or ``[dim, 1, W]``."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    weight = weight.reshape(weight.shape[0], weight.shape[-1]) if weight.dim() == 3 else weight
    n, dim = x.shape
    width = weight.shape[1]
    batch = cu_seqlens.numel() - 1
    assert x.stride(1) == 1 and conv_state.shape[1:] == (dim, width - 1)
    assert state_indices is None or state_indices.shape == (batch,)
    assert x_copy is None or (x_copy.shape == x.shape and x_copy.stride(1) == 1)
    out = torch.empty(n, dim, dtype=x.dtype, device=x.device)
    if n == 0 or batch == 0:
        return out
    block_d = min(256, triton.next_power_of_2(dim))
    _tree_conv_kernel[(batch, triton.cdiv(dim, block_d))](
        x, weight, bias if bias is not None else x, conv_state,
        state_indices if state_indices is not None else cu_seqlens, parent, cu_seqlens, out,
        x_copy if x_copy is not None else out, x.stride(0), out.stride(0),
        x_copy.stride(0) if x_copy is not None else 0, weight.stride(0), weight.stride(1), *conv_state.stride(), dim,
        W=width, BN=16, BD=block_d, HAS_BIAS=bias is not None, SILU=activation is not None,
        HAS_IDX=state_indices is not None, COPY_X=x_copy is not None, num_warps=4,
    )
    return out


# Runs eagerly every step (see triton_commit._commit_kernel): no specialization on per-step sizes.
@triton.jit(do_not_specialize=["idx_layer_stride", "stride_x_layer", "stride_x"],
            do_not_specialize_on_alignment=["state_indices", "x", "accepted", "parent", "cu_seqlens"])
def _commit_conv_kernel(
    src_ptrs, dst_ptrs, strides, ref, state_indices, idx_layer_stride, x, accepted, parent, cu_seqlens,
    stride_x_layer,
    stride_x, DIM, W: tl.constexpr, WP: tl.constexpr, BD: tl.constexpr, COPY_UNCHANGED: tl.constexpr,
):
    b, pid_d, layer = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    a = tl.load(accepted + b)
    if not COPY_UNCHANGED:
        if a < 0:
            return
    bos = tl.load(cu_seqlens + b).to(tl.int64)
    slot = tl.load(state_indices + layer * idx_layer_stride + b).to(tl.int64)
    o_d = pid_d * BD + tl.arange(0, BD)
    o_t = tl.arange(0, WP)
    # New entry t (W-2 = most recent) is s = W-2-t steps back from the accepted node along its path,
    # then the old state once the path runs out.
    src_node = tl.full([WP], -1, tl.int64)
    src_entry = tl.zeros([WP], dtype=tl.int32)
    cur = a.to(tl.int64)
    used_state = a * 0
    for s in tl.static_range(W - 1):
        src_node = tl.where(o_t == W - 2 - s, cur, src_node)
        src_entry = tl.where(o_t == W - 2 - s, W - 2 - used_state, src_entry)
        on_path = cur >= 0
        used_state += tl.where(on_path, 0, 1)
        cur = tl.load(parent + bos + cur, mask=on_path, other=-1).to(tl.int64)
    st = strides + layer * 6
    src = tl.load(src_ptrs + layer).to(tl.pointer_type(ref.dtype.element_ty))
    dst = tl.load(dst_ptrs + layer).to(tl.pointer_type(ref.dtype.element_ty))
    m = (o_d < DIM)[:, None] & (o_t < W - 1)[None, :]
    on_path = (src_node >= 0)[None, :]
    from_x = tl.load(x + layer * stride_x_layer + (bos + src_node)[None, :] * stride_x + o_d[:, None],
                     mask=m & on_path, other=0.0)
    from_state = tl.load(src + slot * tl.load(st) + o_d[:, None] * tl.load(st + 1)
                         + src_entry[None, :] * tl.load(st + 2), mask=m & ~on_path, other=0.0)
    new = tl.where(on_path, from_x.to(tl.float32), from_state.to(tl.float32))
    # In place, entry t is read for an entry before it: finish every read before the first write.
    tl.debug_barrier()
    tl.store(dst + slot * tl.load(st + 3) + o_d[:, None] * tl.load(st + 4) + o_t[None, :] * tl.load(st + 5),
             new.to(ref.dtype.element_ty), mask=m)


def _launch_commit(srcs, dsts, state_indices, xs, parent, cu_seqlens, accepted, copy_unchanged):
    batch, n_layers = accepted.numel(), len(dsts)
    if batch == 0 or n_layers == 0:
        return
    ref = dsts[0]
    dim, width = ref.shape[1], ref.shape[2] + 1
    assert xs.shape[0] == n_layers and xs.shape[2] == dim and xs.stride(2) == 1

    def plan():
        assert all(t.dtype == ref.dtype and t.shape[1:] == ref.shape[1:] for t in list(srcs) + list(dsts))
        return (device_table([[t.data_ptr() for t in srcs], [t.data_ptr() for t in dsts]], ref.device),
                device_table([list(s.stride()) + list(d.stride()) for s, d in zip(srcs, dsts)], ref.device))

    ptrs, strides = launch_plan("commit_conv", [*srcs, *dsts], plan)
    block_d = min(256, triton.next_power_of_2(dim))
    _commit_conv_kernel[(batch, triton.cdiv(dim, block_d), n_layers)](
        ptrs[0], ptrs[1], strides, ref, state_indices, state_indices.stride(0) if state_indices.dim() == 2 else 0,
        xs, accepted, parent, cu_seqlens,
        xs.stride(0), xs.stride(1), dim, W=width, WP=max(2, triton.next_power_of_2(width - 1)), BD=block_d,
        COPY_UNCHANGED=copy_unchanged, num_warps=4,
    )


def commit_conv_state(conv_state, x, parent, cu_seqlens, accepted):
    """Same contract as :func:`reference.commit_conv_state` (returns a new ``[B, dim, W-1]`` tensor)."""
    out = torch.empty_like(conv_state)
    slots = torch.arange(accepted.numel(), dtype=torch.int32, device=x.device)
    _launch_commit([conv_state], [out], slots, x[None], parent, cu_seqlens, accepted, copy_unchanged=True)
    return out


def commit_conv_state_inplace(conv_states, state_indices, xs, parent, cu_seqlens, accepted):
    """Same contract as :func:`reference.commit_conv_state_inplace`: all L layers in one launch
    (``state_indices``: ``[B]`` shared by all layers or ``[L, B]`` per layer, row-contiguous)."""
    conv_states = list(conv_states)
    _launch_commit(conv_states, conv_states, state_indices, xs, parent, cu_seqlens, accepted,
                   copy_unchanged=False)
