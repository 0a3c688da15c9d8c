"""Readable torch reference of closed-form tree GDN verification and the factored state commit.

Math (BOLE.md, Theorem 1), per request and value head, with S_pre the committed state (dk x dv), P_i the
product of decays gamma = exp(g) over root..i, and A(i) the strict ancestors of i:

    G_ij = beta_i (P_i / P_j) (k_i . k_j)         j in A(i)
    C_ij =        (P_i / P_j) (q_i . k_j)         j in A(i) + {i}
    (I + G) U = diag(beta) (V - diag(P) K S_pre)  (unit lower triangular: ancestors precede descendants)
    O = diag(P) Q S_pre + C U

State layout follows vLLM 0.26 (``gated_delta_net_state_shape``): ``[HV, dv, dk]``, i.e. S transposed.
The factors (k, u, log P) are all the commit needs:  S_new = P_a S_pre + sum_{j on root..a} (P_a / P_j) k_j u_j^T.
"""

from dataclasses import dataclass

import torch

from ..forest import ancestor_mask, path_to_root


@dataclass
class TreeFactors:
    """Token-level factors of a verified forest (one GDN layer, or ``L`` layers stacked on a leading dim).

    k: ``[(L,) N, HK, dk]`` float32, the keys as the recurrence used them (after the optional L2 norm).
    u: ``[(L,) N, HV, dv]`` float32, the delta-rule updates u_i = beta_i (v_i - S~_i^T k_i).
    g_cum: ``[(L,) N, HV]`` float32, log P_i = sum of g over root..i.
    """

    k: torch.Tensor
    u: torch.Tensor
    g_cum: torch.Tensor


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """(g, beta) ``[N, H]`` float32 from the layer's ``a``, ``b`` ``[N, H]`` projections, as vLLM's
    ``fused_gdn_gating`` computes them: g = -exp(A_log) softplus(a + dt_bias) (softplus linear above 20),
    beta = sigmoid(b), rounded to b's dtype."""
    x = a.float() + dt_bias.float()
    g = -A_log.float().exp() * torch.where(x <= 20.0, torch.log(1 + torch.exp(x)), x)
    return g, torch.sigmoid(b.float()).to(b.dtype).float()


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # Same formula as FLA's l2norm used by vLLM's GDN kernels.
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def tree_gdn_verify(q, k, v, g, beta, initial_state, parent, cu_seqlens, *, scale=None,
                    use_qk_l2norm_in_kernel=False, state_indices=None):
    """Outputs of every node of a packed forest from the committed state, plus the factors for the commit.

    q, k: ``[N, HK, dk]``; v: ``[N, HV, dv]`` (HV a multiple of HK; value head h uses key head h // (HV/HK));
    g: ``[N, HV]`` log decay; beta: ``[N, HV]``; initial_state: ``[B, HV, dv, dk]`` float32;
    parent: ``[N]`` int32 local parent index (-1 = root); cu_seqlens: ``[B+1]`` int32.
    state_indices: ``[B]``, when given initial_state is a state cache and request b starts from its row
    ``state_indices[b]``. Returns o ``[N, HV, dv]`` (dtype of v) and a :class:`TreeFactors`.
    """
    if state_indices is not None:
        initial_state = initial_state[state_indices.long()]
    n, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    group = hv // hk
    scale = dk ** -0.5 if scale is None else scale
    qf, kf = q.float(), k.float()
    if use_qk_l2norm_in_kernel:
        qf, kf = l2norm(qf), l2norm(kf)
    qf = qf * scale
    # Expand key heads to value heads: [N, HV, dk].
    qh = qf.repeat_interleave(group, dim=1)
    kh = kf.repeat_interleave(group, dim=1)
    vf, gf, bf = v.float(), g.float(), beta.float()

    o = torch.empty(n, hv, dv, dtype=torch.float32, device=q.device)
    u = torch.empty(n, hv, dv, dtype=torch.float32, device=q.device)
    g_cum = torch.empty(n, hv, dtype=torch.float32, device=q.device)
    cu = cu_seqlens.tolist()
    for b in range(len(cu) - 1):
        s, e = cu[b], cu[b + 1]
        if s == e:
            continue
        anc = ancestor_mask(parent[s:e]).float()                       # [T, T], includes self
        strict = anc - torch.eye(e - s, device=q.device)
        # Per head: [HV, T, *]
        Q, K, V = qh[s:e].transpose(0, 1), kh[s:e].transpose(0, 1), vf[s:e].transpose(0, 1)
        logp = (anc @ gf[s:e]).transpose(0, 1)                         # [HV, T]
        beta_b = bf[s:e].transpose(0, 1)                               # [HV, T]
        S = initial_state[b].float().transpose(-1, -2)                 # [HV, dk, dv]
        decay = torch.exp((logp[:, :, None] - logp[:, None, :]).clamp(max=0.0))  # P_i / P_j for j ancestor of i
        G = beta_b[:, :, None] * decay * (K @ K.transpose(-1, -2)) * strict
        C = decay * (Q @ K.transpose(-1, -2)) * anc
        P = torch.exp(logp)[:, :, None]
        R = beta_b[:, :, None] * (V - P * (K @ S))
        I = torch.eye(e - s, device=q.device).expand_as(G)
        U = torch.linalg.solve_triangular(I + G, R, upper=False, unitriangular=True)
        O = P * (Q @ S) + C @ U
        o[s:e] = O.transpose(0, 1)
        u[s:e] = U.transpose(0, 1)
        g_cum[s:e] = logp.transpose(0, 1)
    return o.to(v.dtype), TreeFactors(k=kf, u=u, g_cum=g_cum)


def commit_accepted(initial_state, factors: TreeFactors, accepted, parent, cu_seqlens):
    """State after the recurrence along root..accepted[b] for every request b (``accepted[b] = -1``: unchanged).

    initial_state: ``[B, HV, dv, dk]``; accepted: ``[B]`` local node index. Returns a new ``[B, HV, dv, dk]``
    tensor in the dtype of ``initial_state``.
    """
    hk, hv = factors.k.shape[-2], factors.u.shape[-2]
    group = hv // hk
    new_state = initial_state.clone()
    cu = cu_seqlens.tolist()
    for b, a in enumerate(accepted.tolist()):
        if a < 0:
            continue
        s = cu[b]
        path = [s + j for j in path_to_root(parent[s:cu[b + 1]], a)]
        K = factors.k[path].repeat_interleave(group, dim=1).transpose(0, 1)    # [HV, L, dk]
        U = factors.u[path].transpose(0, 1)                                     # [HV, L, dv]
        logp = factors.g_cum[path].transpose(0, 1)                              # [HV, L]
        w = torch.exp(logp[:, -1:] - logp)                                      # P_a / P_j
        S_T = initial_state[b].float() * torch.exp(logp[:, -1])[:, None, None]
        S_T = S_T + (U * w[:, :, None]).transpose(-1, -2) @ K                   # sum_j w_j u_j k_j^T
        new_state[b] = S_T.to(initial_state.dtype)
    return new_state


def commit_accepted_inplace(states, state_indices, factors: TreeFactors, accepted, parent, cu_seqlens):
    """Commit every layer at once into vLLM's state caches.

    states: list of L per-layer caches ``[num_slots, HV, dv, dk]``; state_indices: ``[B]`` slot of each
    request in every layer, or ``[L, B]`` per layer (layers of different KV-cache groups have different
    slots); factors: stacked ``[L, N, ...]``. Writes ``states[l][slot of b in l]`` for every b with
    ``accepted[b] >= 0``.
    """
    for layer, cache in enumerate(states):
        idx = (state_indices[layer] if state_indices.dim() == 2 else state_indices).long()
        f = TreeFactors(k=factors.k[layer], u=factors.u[layer], g_cum=factors.g_cum[layer])
        cache[idx] = commit_accepted(cache[idx], f, accepted, parent, cu_seqlens)
