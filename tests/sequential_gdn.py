"""Obviously-correct per-node sequential recurrences over a packed forest: the ground truth for the references.

Nothing here shares code with ``vllm_bole``: every node runs the plain recurrence from its parent's state
(or the request's committed state for a root), exactly as vLLM's token-by-token kernels would along the
node's root path.

GDN, per value head h (key head ``h // (HV // HK)``), with S the ``dk x dv`` state:
    S~ = gamma S_parent;  u = beta (v - S~^T k);  S = S~ + k u^T;  o = S^T q
FLA conventions as in vLLM: optional L2 norm ``x / sqrt(sum(x^2) + 1e-6)`` of q and k, then q *= scale
(default ``dk ** -0.5``); states are stored as vLLM stores them, ``[HV, dv, dk]`` (S transposed).

Tree conv1d: a node's window is, oldest first, the committed conv state followed by the inputs of the
root..node path; output = sum over the last W entries of ``weight[:, w] * window[w]`` (+ bias, + SiLU).
"""

import random
import zlib

import torch
import torch.nn.functional as F

from forest_shapes import deep_chain_with_branches, make_tree


# ---------------------------------------------------------------------------------------------------------
# Small test utilities shared by the reference tests.
# ---------------------------------------------------------------------------------------------------------
def seed_of(*params) -> int:
    """A per-test seed derived from the test's parameters (stable across runs and processes)."""
    return zlib.crc32(repr(params).encode())


def build_forest(spec, rng: random.Random):
    """Pack trees given as ``[(shape, t), ...]``; shape is a ``forest_shapes.SHAPES`` name or "deep"
    (``deep_chain_with_branches``). Returns (parent [N] int32, cu_seqlens [B+1] int32)."""
    parents, cu = [], [0]
    for shape, t in spec:
        tree = deep_chain_with_branches(t, rng) if shape == "deep" else make_tree(shape, t, rng)
        parents += tree
        cu.append(cu[-1] + len(tree))
    return torch.tensor(parents, dtype=torch.int32), torch.tensor(cu, dtype=torch.int32)


def max_depth(parent_list) -> int:
    depth = []
    for p in parent_list:
        depth.append(0 if p < 0 else depth[p] + 1)
    return max(depth)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Max abs error relative to the magnitude (max abs) of the expected tensor."""
    a, e = actual.double(), expected.double()
    assert a.shape == e.shape, (a.shape, e.shape)
    return ((a - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()


def _segments(cu_seqlens):
    cu = [int(c) for c in cu_seqlens]
    return [(b, cu[b], cu[b + 1]) for b in range(len(cu) - 1)]


def fla_l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def sequential_tree_gdn(q, k, v, g, beta, initial_state, parent, cu_seqlens, *, scale=None,
                        use_qk_l2norm=False, dtype=torch.float64):
    """Per-node GDN recurrence.

    Returns ``(o [N, HV, dv], states [N, HV, dv, dk], u [N, HV, dv])`` in ``dtype``: node i's output, the
    state right after node i (vLLM layout, S transposed) and its delta-rule update u_i.
    """
    n, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    assert hv % hk == 0
    key_head = torch.tensor([h // (hv // hk) for h in range(hv)])
    scale = dk ** -0.5 if scale is None else scale
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = fla_l2norm(q), fla_l2norm(k)
    q = q * scale
    par = [int(p) for p in parent]

    o = torch.zeros(n, hv, dv, dtype=dtype)
    states = torch.zeros(n, hv, dv, dk, dtype=dtype)
    us = torch.zeros(n, hv, dv, dtype=dtype)
    for b, s, e in _segments(cu_seqlens):
        s_pre = initial_state[b].to(dtype).transpose(-1, -2)         # [HV, dk, dv] = S
        for i in range(s, e):
            s_parent = s_pre if par[i] < 0 else states[s + par[i]].transpose(-1, -2)
            qi, ki = q[i, key_head], k[i, key_head]                    # [HV, dk]
            gamma = torch.exp(g[i])                                    # [HV]
            s_tilde = gamma[:, None, None] * s_parent                  # S~ = gamma S
            pred = torch.einsum("hkv,hk->hv", s_tilde, ki)             # S~^T k
            u = beta[i][:, None] * (v[i] - pred)                       # u = beta (v - S~^T k)
            s_new = s_tilde + torch.einsum("hk,hv->hkv", ki, u)        # S = S~ + k u^T
            o[i] = torch.einsum("hkv,hk->hv", s_new, qi)               # o = S^T q
            states[i] = s_new.transpose(-1, -2)
            us[i] = u
    return o, states, us


def sequential_tree_conv1d(x, weight, bias, conv_state, parent, cu_seqlens, activation="silu",
                           dtype=torch.float64):
    """Per-node depthwise causal conv over a forest.

    x: ``[N, dim]``; weight: ``[dim, W]``; conv_state: ``[B, dim, W-1]`` (entry W-2 most recent).
    Returns ``(out [N, dim], windows [N, dim, W-1])`` in ``dtype``: node i's output and the conv state a
    commit at node i must leave (the last W-1 inputs along root..i, oldest first).
    """
    n, dim = x.shape
    width = weight.shape[1]
    par = [int(p) for p in parent]
    xw, w = x.to(dtype), weight.to(dtype)
    out = torch.zeros(n, dim, dtype=dtype)
    windows = torch.zeros(n, dim, width - 1, dtype=dtype)
    for b, s, e in _segments(cu_seqlens):
        state = conv_state[b].to(dtype)
        for i in range(s, e):
            # lag 0 is node i itself, lag m its m-th ancestor; past the root, the committed state.
            lagged, node = [], i
            while node is not None and len(lagged) < width:
                lagged.append(xw[node])
                node = s + par[node] if par[node] >= 0 else None
            on_path = len(lagged)
            for m in range(on_path, width):
                # lag on_path is the most recent committed input (index W-2), then older ones.
                lagged.append(state[:, (width - 2) - (m - on_path)])
            y = sum(w[:, width - 1 - m] * lagged[m] for m in range(width))
            if bias is not None:
                y = y + bias.to(dtype)
            out[i] = F.silu(y) if activation in ("silu", "swish") else y
            for j in range(width - 1):                                  # oldest (lag W-2) .. newest (lag 0)
                windows[i, :, j] = lagged[width - 2 - j]
    return out, windows


MULTI_SPEC = [("single", 1), ("chain", 7), ("kary3", 13), ("random", 21), ("forest", 11), ("deep", 34),
              ("star", 5), ("kary2", 2)]

# Named forests every kernel test sweeps (each a list of (shape, nodes) trees packed into one call).
NAMED_SPECS = {
    "single": [("single", 1)],
    "chain": [("chain", 20)],
    "star": [("star", 9)],
    "kary2": [("kary2", 15)],
    "kary3": [("kary3", 13)],
    "kary4": [("kary4", 21)],
    "random": [("random", 25)],
    "forest": [("forest", 24)],
    "deep": [("deep", 40)],
    "multi": MULTI_SPEC,
}


def random_gdn_inputs(parent, cu, hk, hv, dk, dv, *, l2norm_qk, seed, gate_scale=0.5):
    """float32 (q, k, v, g, beta, initial_state) in the ranges vLLM feeds (g <= 0 log decay, beta in (0, 1))."""
    gen = torch.Generator().manual_seed(seed)
    n, b = parent.numel(), cu.numel() - 1
    q = torch.randn(n, hk, dk, generator=gen)
    k = torch.randn(n, hk, dk, generator=gen)
    if not l2norm_qk:
        # Without the in-kernel norm keep |k|^2 modest so the delta rule stays contractive at depth.
        q, k = q / dk ** 0.5, 0.7 * k / dk ** 0.5
    v = torch.randn(n, hv, dv, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(n, hv, generator=gen)) * gate_scale
    beta = torch.sigmoid(torch.randn(n, hv, generator=gen))
    s0 = 0.5 * torch.randn(b, hv, dv, dk, generator=gen)
    return q, k, v, g, beta, s0
