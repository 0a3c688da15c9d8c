"""Bole's kernels: one signature per op; CUDA tensors run Triton, CPU tensors run the torch reference.

``VLLM_BOLE_KERNELS=reference`` forces the reference on CUDA too (debugging, bisecting a mismatch).
"""

import torch

from .. import envs
from . import reference
from .reference import TreeFactors


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and envs.VLLM_BOLE_KERNELS != "reference"


def tree_gdn_verify(q, k, v, g, beta, initial_state, parent, cu_seqlens, *, scale=None,
                    use_qk_l2norm_in_kernel=False, state_indices=None, out_factors=None, max_seqlen=None,
                    bits=None, out=None):
    """Every node's GDN output from the committed state; see :func:`reference.tree_gdn_verify`.

    out_factors: preallocated :class:`TreeFactors` that receive the factors; out: a preallocated ``[N, HV, dv]``
    tensor (dtype of v) that receives the output. max_seqlen and bits (the forest's ancestor bitmask,
    :func:`tree_gdn.triton_verify.ancestor_bits`) are per-forest hints that spare the Triton path a host sync
    and a mask build per layer; the reference ignores them.
    """
    if _use_triton(q):
        from .tree_gdn.triton_verify import tree_gdn_verify as impl

        return impl(q, k, v, g, beta, initial_state, parent, cu_seqlens, scale=scale,
                    use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, state_indices=state_indices,
                    out_factors=out_factors, max_seqlen=max_seqlen, bits=bits, out=out)
    o, factors = reference.tree_gdn_verify(q, k, v, g, beta, initial_state, parent, cu_seqlens, scale=scale,
                                           use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                           state_indices=state_indices)
    if out is not None:
        o = out.copy_(o)
    if out_factors is None:
        return o, factors
    for dst, src in zip((out_factors.k, out_factors.u, out_factors.g_cum), (factors.k, factors.u, factors.g_cum)):
        dst.copy_(src)
    return o, out_factors


def gdn_gates(a, b, A_log, dt_bias):
    """GDN decay and update gates from strided projections; see :func:`reference.gdn_gates`."""
    if _use_triton(a):
        from .tree_gdn.triton_gates import gdn_gates as impl
    else:
        impl = reference.gdn_gates
    return impl(a, b, A_log, dt_bias)


def commit_accepted(initial_state, factors, accepted, parent, cu_seqlens):
    """State after the accepted path; see :func:`reference.commit_accepted`."""
    if _use_triton(initial_state):
        from .tree_gdn.triton_commit import commit_accepted as impl
    else:
        impl = reference.commit_accepted
    return impl(initial_state, factors, accepted, parent, cu_seqlens)


def commit_accepted_inplace(states, state_indices, factors, accepted, parent, cu_seqlens):
    """Commit all layers into vLLM's state caches; see :func:`reference.commit_accepted_inplace`."""
    if _use_triton(factors.u):
        from .tree_gdn.triton_commit import commit_accepted_inplace as impl
    else:
        impl = reference.commit_accepted_inplace
    return impl(states, state_indices, factors, accepted, parent, cu_seqlens)


def tree_causal_conv1d(x, weight, bias, conv_state, parent, cu_seqlens, activation="silu", *,
                       state_indices=None, x_copy=None):
    """Depthwise causal conv along ancestor paths; see :func:`reference.tree_causal_conv1d`."""
    if _use_triton(x):
        from .tree_conv1d.triton_conv import tree_causal_conv1d as impl
    else:
        impl = reference.tree_causal_conv1d
    return impl(x, weight, bias, conv_state, parent, cu_seqlens, activation=activation,
                state_indices=state_indices, x_copy=x_copy)


def commit_conv_state(conv_state, x, parent, cu_seqlens, accepted):
    """Conv window after the accepted path; see :func:`reference.commit_conv_state`."""
    if _use_triton(x):
        from .tree_conv1d.triton_conv import commit_conv_state as impl
    else:
        impl = reference.commit_conv_state
    return impl(conv_state, x, parent, cu_seqlens, accepted)


def commit_conv_state_inplace(conv_states, state_indices, xs, parent, cu_seqlens, accepted):
    """Commit all layers' conv windows into vLLM's caches; see :func:`reference.commit_conv_state_inplace`."""
    if _use_triton(xs):
        from .tree_conv1d.triton_conv import commit_conv_state_inplace as impl
    else:
        impl = reference.commit_conv_state_inplace
    return impl(conv_states, state_indices, xs, parent, cu_seqlens, accepted)


__all__ = [
    "TreeFactors", "commit_accepted", "commit_accepted_inplace", "commit_conv_state", "commit_conv_state_inplace",
    "gdn_gates", "tree_causal_conv1d", "tree_gdn_verify",
]
