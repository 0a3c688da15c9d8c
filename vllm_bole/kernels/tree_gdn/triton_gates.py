"""Triton GDN gates from the layer's strided ``b``/``a`` projections, in one launch.

vLLM's ``fused_gdn_gating`` needs contiguous ``a`` and ``b`` (the projection gives column halves of one tensor)
and returns beta in the input dtype, so the GDN layer paid two copies and a cast around it, per layer and step,
each a kernel of its own inside the verification graph. Same values as that path (:func:`reference.gdn_gates`).
"""

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n", "stride_a", "stride_b"])
def _gdn_gates_kernel(a, b, A_log, dt_bias, g_out, beta_out, n, stride_a, stride_b, H: tl.constexpr,
                      BN: tl.constexpr, BH: tl.constexpr, ROUND_BETA: tl.constexpr, SOFTPLUS_MAX: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    heads = tl.arange(0, BH)
    mh = heads < H
    m = (rows < n)[:, None] & mh[None, :]
    rows64 = rows.to(tl.int64)
    x = (tl.load(a + rows64[:, None] * stride_a + heads[None, :], mask=m, other=0.0).to(tl.float32)
         + tl.load(dt_bias + heads, mask=mh, other=0.0).to(tl.float32)[None, :])
    softplus = tl.where(x <= SOFTPLUS_MAX, tl.log(1 + tl.exp(x)), x)
    g = -tl.exp(tl.load(A_log + heads, mask=mh, other=0.0).to(tl.float32))[None, :] * softplus
    beta = tl.sigmoid(tl.load(b + rows64[:, None] * stride_b + heads[None, :], mask=m, other=0.0).to(tl.float32))
    if ROUND_BETA:   # vLLM's gating stores beta in the input dtype
        beta = beta.to(b.dtype.element_ty).to(tl.float32)
    out = rows64[:, None] * H + heads[None, :]
    tl.store(g_out + out, g, mask=m)
    tl.store(beta_out + out, beta, mask=m)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """Same contract as :func:`reference.gdn_gates`: ``a``, ``b`` ``[N, H]`` with any row stride."""
    n, h = a.shape
    assert b.shape == (n, h) and a.stride(1) == 1 and b.stride(1) == 1
    g = torch.empty(n, h, dtype=torch.float32, device=a.device)
    beta = torch.empty(n, h, dtype=torch.float32, device=a.device)
    if n:
        bn = 16
        _gdn_gates_kernel[(triton.cdiv(n, bn),)](
            a, b, A_log, dt_bias, g, beta, n, a.stride(0), b.stride(0), H=h, BN=bn,
            BH=triton.next_power_of_2(h), ROUND_BETA=b.dtype != torch.float32, SOFTPLUS_MAX=20.0, num_warps=2)
    return g, beta
