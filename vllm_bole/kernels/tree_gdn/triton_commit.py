"""Triton factored-state commit: S_new = P_a S_pre + sum_{j on root..a} (P_a / P_j) u_j k_j^T (BOLE.md).

One launch commits every request, value head and layer. Layers are reached through a table of per-layer base
addresses (the views share one set of strides, which may be padded), so vLLM's per-layer caches are written
in place without a gather or scatter copy. Each program owns one [BV, dk] block of one (layer, request,
value head) state.
"""

import torch
import triton
import triton.language as tl

from ..launch import device_table, launch_plan
from .reference import TreeFactors


# The commit runs eagerly every step with that step's node count and batch: without specializing on them (or
# on the alignment of the per-step index tensors) a new count never recompiles the kernel mid-run.
@triton.jit(do_not_specialize=["idx_layer_stride", "N"],
            do_not_specialize_on_alignment=["state_indices", "accepted", "parent", "cu_seqlens"])
def _commit_kernel(
    src_ptrs, dst_ptrs, ref, state_indices, idx_layer_stride, k, u, g_cum, accepted, parent, cu_seqlens, N,
    src_slot, src_head, src_v, dst_slot, dst_head, dst_v,
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, NV: tl.constexpr, COPY_UNCHANGED: tl.constexpr, ALIGNED: tl.constexpr,
):
    b, hv, pid = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    layer, vb = pid // NV, pid % NV
    a = tl.load(accepted + b)
    if not COPY_UNCHANGED:
        if a < 0:
            return
    hk = hv // (HV // HK)
    o_k = tl.arange(0, BK)
    o_v = vb * BV + tl.arange(0, BV)
    m = (o_v < DV)[:, None] & (o_k < DK)[None, :]
    slot = tl.load(state_indices + layer * idx_layer_stride + b).to(tl.int64)
    src = tl.load(src_ptrs + layer).to(tl.pointer_type(ref.dtype.element_ty))
    dst = tl.load(dst_ptrs + layer).to(tl.pointer_type(ref.dtype.element_ty))
    if ALIGNED:
        # Addresses read from a table carry no alignment; the host checked it, so allow 16-byte accesses.
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
    S = tl.load(src + slot * src_slot + hv * src_head + o_v[:, None] * src_v + o_k[None, :], mask=m,
                other=0.0).to(tl.float32)
    if a >= 0:
        bos = tl.load(cu_seqlens + b).to(tl.int64)
        base = layer.to(tl.int64) * N
        g_a = tl.load(g_cum + (base + bos + a) * HV + hv)
        S *= tl.exp(g_a)
        node = a.to(tl.int64)
        # Walk the accepted path upward; each node adds one rank-1 term.
        while node >= 0:
            j = base + bos + node
            w = tl.exp(g_a - tl.load(g_cum + j * HV + hv))
            u_j = tl.load(u + (j * HV + hv) * DV + o_v, mask=o_v < DV, other=0.0)
            k_j = tl.load(k + (j * HK + hk) * DK + o_k, mask=o_k < DK, other=0.0)
            S += (w * u_j)[:, None] * k_j[None, :]
            node = tl.load(parent + bos + node).to(tl.int64)
    tl.store(dst + slot * dst_slot + hv * dst_head + o_v[:, None] * dst_v + o_k[None, :],
             S.to(ref.dtype.element_ty), mask=m)


def _launch(srcs, dsts, state_indices, factors: TreeFactors, accepted, parent, cu_seqlens, copy_unchanged,
            block_v=64, num_warps=4):
    n_layers, n = factors.u.shape[0], factors.u.shape[1]
    hk, dk = factors.k.shape[-2:]
    hv, dv = factors.u.shape[-2:]
    batch = accepted.numel()
    if batch == 0 or n_layers == 0:
        return
    ref = dsts[0]

    def plan():
        assert all(t.dtype == ref.dtype and t.shape[1:] == (hv, dv, dk) for t in list(srcs) + list(dsts))
        # One set of strides serves every layer (vLLM's per-layer caches are views of one shape).
        assert all(t.stride() == srcs[0].stride() for t in srcs) and all(t.stride() == ref.stride() for t in dsts)
        assert srcs[0].stride(-1) == 1 and ref.stride(-1) == 1, "the state's last (dk) dim must be contiguous"
        return (device_table([[t.data_ptr() for t in srcs], [t.data_ptr() for t in dsts]], ref.device),
                all(t.data_ptr() % 16 == 0 for t in list(srcs) + list(dsts)))

    ptrs, aligned = launch_plan(f"commit{(hv, dv, dk)}", [*srcs, *dsts], plan)
    block_v = min(block_v, max(16, triton.next_power_of_2(dv)))
    nv = triton.cdiv(dv, block_v)
    _commit_kernel[(batch, hv, n_layers * nv)](
        ptrs[0], ptrs[1], ref, state_indices, state_indices.stride(0) if state_indices.dim() == 2 else 0,
        factors.k.contiguous(), factors.u.contiguous(),
        factors.g_cum.contiguous(), accepted, parent, cu_seqlens, n, *srcs[0].stride()[:3], *ref.stride()[:3],
        HK=hk, HV=hv, DK=dk, DV=dv, BK=max(16, triton.next_power_of_2(dk)), BV=block_v, NV=nv,
        COPY_UNCHANGED=copy_unchanged, ALIGNED=aligned, num_warps=num_warps,
    )


def commit_accepted(initial_state, factors: TreeFactors, accepted, parent, cu_seqlens):
    """Same contract as :func:`reference.commit_accepted` (returns a new ``[B, HV, dv, dk]`` tensor)."""
    initial_state = initial_state if initial_state.stride(-1) == 1 else initial_state.contiguous()
    out = torch.empty_like(initial_state)
    stacked = TreeFactors(k=factors.k[None], u=factors.u[None], g_cum=factors.g_cum[None])
    slots = torch.arange(accepted.numel(), dtype=torch.int32, device=initial_state.device)
    _launch([initial_state], [out], slots, stacked, accepted, parent, cu_seqlens, copy_unchanged=True)
    return out


def commit_accepted_inplace(states, state_indices, factors: TreeFactors, accepted, parent, cu_seqlens, *,
                            block_v=64, num_warps=4):
    """Same contract as :func:`reference.commit_accepted_inplace`: all L layers in one launch
    (``state_indices``: ``[B]`` shared by all layers or ``[L, B]`` per layer, row-contiguous)."""
    states = list(states)
    _launch(states, states, state_indices, factors, accepted, parent, cu_seqlens, copy_unchanged=False,
            block_v=block_v, num_warps=num_warps)
