"""The closed-form tree GDN reference (verify + factored commit) against a per-node sequential recurrence."""

import random

import pytest
import torch

import vllm_bole.kernels as kernels
from sequential_gdn import (MULTI_SPEC, NAMED_SPECS, build_forest, fla_l2norm, max_depth, random_gdn_inputs,
                            rel_err, seed_of, sequential_tree_gdn)
from vllm_bole.kernels.tree_gdn.reference import (
    TreeFactors,
    commit_accepted,
    commit_accepted_inplace,
    l2norm,
    tree_gdn_verify,
)

FP32_TOL = 1e-4
BF16_TOL = 2e-2


def make_inputs(parent, cu, hk, hv, dk, dv, *, l2norm_qk, seed, dtype=torch.float32, gate_scale=0.5):
    *qkvgb, s0 = random_gdn_inputs(parent, cu, hk, hv, dk, dv, l2norm_qk=l2norm_qk, seed=seed,
                                   gate_scale=gate_scale)
    return tuple(t.to(dtype) for t in qkvgb) + (s0,)


def run_both(spec, hk, hv, dk, dv, *, l2norm_qk, scale=None, seed_params=()):
    rng = random.Random(seed_of("forest", spec, *seed_params))
    parent, cu = build_forest(spec, rng)
    q, k, v, g, beta, s0 = make_inputs(parent, cu, hk, hv, dk, dv, l2norm_qk=l2norm_qk,
                                       seed=seed_of("inputs", spec, hk, hv, dk, dv, l2norm_qk, *seed_params))
    s0_before = s0.clone()
    o, factors = tree_gdn_verify(q, k, v, g, beta, s0, parent, cu, scale=scale,
                                 use_qk_l2norm_in_kernel=l2norm_qk)
    assert torch.equal(s0, s0_before), "verify must not modify the committed state"
    o_seq, states_seq, u_seq = sequential_tree_gdn(q, k, v, g, beta, s0, parent, cu, scale=scale,
                                                   use_qk_l2norm=l2norm_qk)
    return dict(parent=parent, cu=cu, q=q, k=k, v=v, g=g, beta=beta, s0=s0, o=o, factors=factors,
                o_seq=o_seq, states_seq=states_seq, u_seq=u_seq)


TREE_CASES = [("single", 1)] + [
    (shape, t) for shape in ("chain", "star", "kary2", "kary3", "kary4", "random", "forest", "deep")
    for t in (2, 9, 40)
]


@pytest.mark.parametrize("l2norm_qk", [True, False])
@pytest.mark.parametrize("shape,t", TREE_CASES)
def test_verify_matches_sequential(shape, t, l2norm_qk):
    r = run_both([(shape, t)], 2, 4, 16, 8, l2norm_qk=l2norm_qk, seed_params=(shape, t))
    assert r["o"].dtype == torch.float32 and r["o"].shape == (r["parent"].numel(), 4, 8)
    assert torch.isfinite(r["o"]).all()
    assert rel_err(r["o"], r["o_seq"]) <= FP32_TOL
    assert rel_err(r["factors"].u, r["u_seq"]) <= FP32_TOL


@pytest.mark.parametrize("shape", ["chain", "deep", "random", "kary4", "forest"])
@pytest.mark.parametrize("t", [64, 128, 256])
def test_verify_large_trees(shape, t):
    r = run_both([(shape, t)], 1, 2, 8, 8, l2norm_qk=True, seed_params=("large", shape, t))
    if shape in ("chain", "deep"):
        assert max_depth(r["parent"].tolist()) >= 16
    assert torch.isfinite(r["o"]).all()
    assert rel_err(r["o"], r["o_seq"]) <= FP32_TOL


def test_verify_and_commit_batch_of_sizes_1_to_256():
    """One call holding requests of 1 .. 256 nodes."""
    spec = [("single", 1), ("chain", 3), ("random", 17), ("kary4", 64), ("forest", 100), ("deep", 256)]
    r = run_both(spec, 1, 2, 8, 4, l2norm_qk=True, seed_params=("sizes",))
    assert rel_err(r["o"], r["o_seq"]) <= FP32_TOL
    cu_l = r["cu"].tolist()
    rng = random.Random(seed_of("sizes-acc"))
    acc = [rng.randrange(cu_l[b + 1] - cu_l[b]) for b in range(len(cu_l) - 1)]
    acc[-1] = cu_l[-1] - cu_l[-2] - 1
    new = commit_accepted(r["s0"], r["factors"], torch.tensor(acc), r["parent"], r["cu"])
    for b, a in enumerate(acc):
        assert rel_err(new[b], r["states_seq"][cu_l[b] + a]) <= FP32_TOL


@pytest.mark.parametrize("hk,hv,dk,dv", [
    (1, 1, 8, 8), (2, 4, 16, 8), (3, 6, 8, 16), (1, 4, 32, 16), (2, 2, 128, 128), (2, 4, 128, 128),
])
def test_verify_head_grouping_and_dims(hk, hv, dk, dv):
    spec = MULTI_SPEC if dk < 128 else [("kary2", 7), ("chain", 5), ("forest", 6)]
    r = run_both(spec, hk, hv, dk, dv, l2norm_qk=True, seed_params=("dims", hk, hv, dk, dv))
    assert r["o"].shape == (r["parent"].numel(), hv, dv)
    assert rel_err(r["o"], r["o_seq"]) <= FP32_TOL
    assert r["factors"].k.shape == (r["parent"].numel(), hk, dk)  # keys stay per key head


def test_verify_grouping_uses_contiguous_key_head_blocks():
    """Value head h reads key head h // (HV/HK): permuting key heads moves whole groups of value heads."""
    hk, hv = 2, 6
    r = run_both([("random", 12)], hk, hv, 8, 8, l2norm_qk=True, seed_params=("group",))
    q2, k2 = r["q"].flip(1), r["k"].flip(1)
    o2, _ = tree_gdn_verify(q2, k2, r["v"], r["g"], r["beta"], r["s0"], r["parent"], r["cu"],
                            use_qk_l2norm_in_kernel=True)
    o2_seq, _, _ = sequential_tree_gdn(q2, k2, r["v"], r["g"], r["beta"], r["s0"], r["parent"], r["cu"],
                                       use_qk_l2norm=True)
    assert rel_err(o2, o2_seq) <= FP32_TOL
    assert rel_err(o2, r["o"]) > 1e-2  # the key heads matter, so the swap must show


def test_several_requests_are_independent():
    """Packing requests together gives each one exactly the result it gets alone."""
    r = run_both(MULTI_SPEC, 2, 4, 16, 8, l2norm_qk=True, seed_params=("indep",))
    assert rel_err(r["o"], r["o_seq"]) <= FP32_TOL
    cu = r["cu"].tolist()
    for b in range(len(cu) - 1):
        s, e = cu[b], cu[b + 1]
        one_cu = torch.tensor([0, e - s], dtype=torch.int32)
        o_b, f_b = tree_gdn_verify(r["q"][s:e], r["k"][s:e], r["v"][s:e], r["g"][s:e], r["beta"][s:e],
                                   r["s0"][b:b + 1], r["parent"][s:e], one_cu, use_qk_l2norm_in_kernel=True)
        assert rel_err(o_b, r["o"][s:e]) <= 1e-6
        assert rel_err(f_b.u, r["factors"].u[s:e]) <= 1e-6


def test_empty_request_in_batch():
    parent = torch.tensor([-1, 0, 0, -1, 0, 1], dtype=torch.int32)
    cu = torch.tensor([0, 3, 3, 6], dtype=torch.int32)      # request 1 has no nodes
    q, k, v, g, beta, s0 = make_inputs(parent, cu, 2, 4, 8, 8, l2norm_qk=True, seed=seed_of("empty"))
    o, f = tree_gdn_verify(q, k, v, g, beta, s0, parent, cu, use_qk_l2norm_in_kernel=True)
    o_seq, st_seq, _ = sequential_tree_gdn(q, k, v, g, beta, s0, parent, cu, use_qk_l2norm=True)
    assert rel_err(o, o_seq) <= FP32_TOL
    new = commit_accepted(s0, f, torch.tensor([2, -1, 2]), parent, cu)
    assert torch.equal(new[1], s0[1])
    assert rel_err(new[0], st_seq[2]) <= FP32_TOL and rel_err(new[2], st_seq[5]) <= FP32_TOL


@pytest.mark.parametrize("l2norm_qk", [True, False])
@pytest.mark.parametrize("scale", [0.37, 1.0, 2.5])
def test_custom_scale(scale, l2norm_qk):
    spec = [("random", 10), ("kary2", 9)]
    r = run_both(spec, 2, 4, 16, 8, l2norm_qk=l2norm_qk, scale=scale, seed_params=("scale", scale))
    assert rel_err(r["o"], r["o_seq"]) <= FP32_TOL
    o_default, _ = tree_gdn_verify(r["q"], r["k"], r["v"], r["g"], r["beta"], r["s0"], r["parent"], r["cu"],
                                   use_qk_l2norm_in_kernel=l2norm_qk)
    o_default_seq, _, _ = sequential_tree_gdn(r["q"], r["k"], r["v"], r["g"], r["beta"], r["s0"],
                                              r["parent"], r["cu"], use_qk_l2norm=l2norm_qk)
    assert rel_err(o_default, o_default_seq) <= FP32_TOL
    # o is linear in q, and the scale multiplies q only (not k): o(scale) = scale * sqrt(dk) * o(default).
    assert rel_err(r["o"], o_default * (scale * 16 ** 0.5)) <= FP32_TOL
    # Factors must not depend on the q scale.
    _, f_default = tree_gdn_verify(r["q"], r["k"], r["v"], r["g"], r["beta"], r["s0"], r["parent"], r["cu"],
                                   use_qk_l2norm_in_kernel=l2norm_qk)
    assert rel_err(r["factors"].u, f_default.u) <= 1e-6


def test_l2norm_matches_fla_formula():
    gen = torch.Generator().manual_seed(seed_of("l2norm"))
    x = torch.randn(5, 3, 16, generator=gen)
    x[0, 0] = 0.0                       # the eps keeps a zero vector at zero
    x[1, 1] *= 1e-4                     # tiny vectors are damped by the eps, not blown up
    expected = fla_l2norm(x.double())
    assert rel_err(l2norm(x), expected) <= 1e-6
    assert torch.equal(l2norm(x)[0, 0], torch.zeros(16))
    norms = l2norm(x)[2:].norm(dim=-1)
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-5)


def test_l2norm_flag_matters():
    """use_qk_l2norm_in_kernel really normalises q and k (raw inputs with large norms)."""
    rng = random.Random(seed_of("flag"))
    parent, cu = build_forest([("random", 12)], rng)
    q, k, v, g, beta, s0 = make_inputs(parent, cu, 1, 2, 8, 8, l2norm_qk=True, seed=seed_of("flag"))
    q, k = 3.0 * q, 3.0 * k
    o_on, f_on = tree_gdn_verify(q, k, v, g, beta, s0, parent, cu, use_qk_l2norm_in_kernel=True)
    o_on_seq, _, _ = sequential_tree_gdn(q, k, v, g, beta, s0, parent, cu, use_qk_l2norm=True)
    assert rel_err(o_on, o_on_seq) <= FP32_TOL
    assert rel_err(f_on.k, fla_l2norm(k.double())) <= 1e-6          # factors carry the normalised keys
    o_norm_first, _ = tree_gdn_verify(fla_l2norm(q), fla_l2norm(k), v, g, beta, s0, parent, cu)
    assert rel_err(o_on, o_norm_first) <= 1e-5
    o_off, _ = tree_gdn_verify(q, k, v, g, beta, s0, parent, cu, use_qk_l2norm_in_kernel=False)
    assert rel_err(o_off, o_on) > 1e-2


@pytest.mark.parametrize("gates_bf16", [False, True])
@pytest.mark.parametrize("spec", [[("random", 24), ("chain", 18), ("single", 1)], [("kary4", 40)]],
                         ids=["mixed", "kary4"])
def test_bf16_inputs(spec, gates_bf16):
    rng = random.Random(seed_of("bf16", spec, gates_bf16))
    parent, cu = build_forest(spec, rng)
    q, k, v, g, beta, s0 = make_inputs(parent, cu, 2, 4, 32, 16, l2norm_qk=True,
                                       seed=seed_of("bf16-in", spec, gates_bf16))
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    if gates_bf16:
        g, beta = g.bfloat16(), beta.bfloat16()
    o, f = tree_gdn_verify(q, k, v, g, beta, s0, parent, cu, use_qk_l2norm_in_kernel=True)
    assert o.dtype == torch.bfloat16 and torch.isfinite(o.float()).all()
    # Ground truth: the fp32 sequential recurrence on the same (bf16-valued) inputs.
    o_seq, st_seq, _ = sequential_tree_gdn(q, k, v, g, beta, s0, parent, cu, use_qk_l2norm=True,
                                           dtype=torch.float32)
    assert rel_err(o, o_seq) <= BF16_TOL
    cu_l = cu.tolist()
    last = torch.tensor([cu_l[b + 1] - cu_l[b] - 1 for b in range(len(cu_l) - 1)])
    new = commit_accepted(s0, f, last, parent, cu)
    assert new.dtype == torch.float32
    for b in range(len(cu_l) - 1):
        assert rel_err(new[b], st_seq[cu_l[b] + last[b]]) <= BF16_TOL
    # A bf16 state cache: the commit comes back in bf16 and stays close.
    new_bf16 = commit_accepted(s0.bfloat16(), f, last, parent, cu)
    assert new_bf16.dtype == torch.bfloat16
    for b in range(len(cu_l) - 1):
        assert rel_err(new_bf16[b], st_seq[cu_l[b] + last[b]]) <= BF16_TOL


@pytest.mark.parametrize("case", ["decay_underflow", "no_decay", "zero_qk", "beta_extremes", "mixed_extremes"])
def test_never_nan(case):
    rng = random.Random(seed_of("nan", case))
    spec = [("chain", 256)] if case == "decay_underflow" else [("deep", 64), ("forest", 30), ("kary2", 31)]
    parent, cu = build_forest(spec, rng)
    q, k, v, g, beta, s0 = make_inputs(parent, cu, 1, 2, 8, 8, l2norm_qk=True, seed=seed_of("nan-in", case))
    if case == "decay_underflow":
        g = -30.0 - 50.0 * torch.rand(g.shape, generator=torch.Generator().manual_seed(1))  # P underflows to 0
    elif case == "no_decay":
        g = torch.zeros_like(g)
    elif case == "zero_qk":
        q[::3] = 0.0
        k[1::4] = 0.0
    elif case == "beta_extremes":
        beta = (torch.arange(beta.numel()).reshape(beta.shape) % 2).float()   # exactly 0 and 1
    else:
        g[::2] = -60.0
        g[1::2] = 0.0
        beta[::5] = 1.0
        k[::7] = 0.0
    o, f = tree_gdn_verify(q, k, v, g, beta, s0, parent, cu, use_qk_l2norm_in_kernel=True)
    assert torch.isfinite(o).all()
    assert torch.isfinite(f.u).all() and torch.isfinite(f.g_cum).all() and torch.isfinite(f.k).all()
    o_seq, st_seq, _ = sequential_tree_gdn(q, k, v, g, beta, s0, parent, cu, use_qk_l2norm=True)
    assert rel_err(o, o_seq) <= FP32_TOL
    cu_l = cu.tolist()
    last = torch.tensor([cu_l[b + 1] - cu_l[b] - 1 for b in range(len(cu_l) - 1)])
    new = commit_accepted(s0, f, last, parent, cu)
    assert torch.isfinite(new).all()
    for b in range(len(cu_l) - 1):
        assert rel_err(new[b], st_seq[cu_l[b] + last[b]]) <= FP32_TOL


def test_factor_log_decay_is_path_sum():
    rng = random.Random(seed_of("gcum"))
    parent, cu = build_forest(MULTI_SPEC, rng)
    q, k, v, g, beta, s0 = make_inputs(parent, cu, 2, 4, 8, 8, l2norm_qk=False, seed=seed_of("gcum-in"))
    _, f = tree_gdn_verify(q, k, v, g, beta, s0, parent, cu)
    par, cu_l = parent.tolist(), cu.tolist()
    expected = torch.zeros_like(g, dtype=torch.float64)
    for b in range(len(cu_l) - 1):
        for i in range(cu_l[b], cu_l[b + 1]):
            node = i
            while node >= cu_l[b]:
                expected[i] += g[node].double()
                node = cu_l[b] + par[node] if par[node] >= 0 else -1
    assert rel_err(f.g_cum, expected) <= 1e-5
    assert torch.equal(f.k, k.float())        # no norm requested: keys are passed through unscaled


@pytest.mark.parametrize("l2norm_qk", [True, False])
@pytest.mark.parametrize("name", list(NAMED_SPECS))
def test_commit_every_accepted_node(name, l2norm_qk):
    """For every node a of every tree, committing a gives the sequential state after a; -1 keeps S_pre."""
    spec = NAMED_SPECS[name]
    r = run_both(spec, 2, 4, 16, 8, l2norm_qk=l2norm_qk, seed_params=("commit", name))
    s0, f, parent, cu = r["s0"], r["factors"], r["parent"], r["cu"]
    cu_l = cu.tolist()
    sizes = [cu_l[b + 1] - cu_l[b] for b in range(len(cu_l) - 1)]
    if name == "deep":
        assert max_depth(parent.tolist()) >= 16
    s0_before = s0.clone()
    for a in range(max(sizes)):
        accepted = torch.tensor([a if a < t else -1 for t in sizes], dtype=torch.int32)
        new = commit_accepted(s0, f, accepted, parent, cu)
        assert new.shape == s0.shape and new.dtype == s0.dtype
        for b, t in enumerate(sizes):
            if a < t:
                assert rel_err(new[b], r["states_seq"][cu_l[b] + a]) <= FP32_TOL, (b, a)
            else:
                assert torch.equal(new[b], s0[b])
    none = commit_accepted(s0, f, torch.full((len(sizes),), -1, dtype=torch.int32), parent, cu)
    assert torch.equal(none, s0)
    assert torch.equal(s0, s0_before), "commit_accepted must not modify its input"


def test_commit_random_mix_per_request():
    r = run_both(MULTI_SPEC, 2, 4, 16, 8, l2norm_qk=True, seed_params=("mix",))
    cu_l = r["cu"].tolist()
    rng = random.Random(seed_of("mix-acc"))
    for _ in range(5):
        acc = [rng.randrange(-1, cu_l[b + 1] - cu_l[b]) for b in range(len(cu_l) - 1)]
        new = commit_accepted(r["s0"], r["factors"], torch.tensor(acc), r["parent"], r["cu"])
        for b, a in enumerate(acc):
            if a < 0:
                assert torch.equal(new[b], r["s0"][b])
            else:
                assert rel_err(new[b], r["states_seq"][cu_l[b] + a]) <= FP32_TOL


def test_commit_inplace_multilayer_writes_exactly_requested_slots():
    n_layers, num_slots, hk, hv, dk, dv = 3, 9, 2, 4, 16, 8
    spec = [("random", 12), ("deep", 32), ("kary3", 10), ("forest", 9), ("single", 1)]
    rng = random.Random(seed_of("inplace"))
    parent, cu = build_forest(spec, rng)
    cu_l = cu.tolist()
    state_indices = torch.tensor([6, 0, 4, 8, 2], dtype=torch.int32)      # unsorted, with gaps
    accepted = torch.tensor([11, 31, -1, 3, 0], dtype=torch.int32)
    gen = torch.Generator().manual_seed(seed_of("inplace-buf"))
    # Per-layer caches are strided views into one shared buffer (as in vLLM's hybrid allocator).
    buf = 0.5 * torch.randn(num_slots, n_layers, 2, hv, dv, dk, generator=gen)
    caches = [buf[:, layer, 1] for layer in range(n_layers)]
    assert not caches[0].is_contiguous()
    before = buf.clone()

    ks, us, gcs, expected = [], [], [], []
    for layer in range(n_layers):
        q, k, v, g, beta, _ = make_inputs(parent, cu, hk, hv, dk, dv, l2norm_qk=True,
                                          seed=seed_of("inplace-in", layer))
        s0 = caches[layer][state_indices.long()].clone()
        _, f = tree_gdn_verify(q, k, v, g, beta, s0, parent, cu, use_qk_l2norm_in_kernel=True)
        _, st_seq, _ = sequential_tree_gdn(q, k, v, g, beta, s0, parent, cu, use_qk_l2norm=True)
        ks.append(f.k), us.append(f.u), gcs.append(f.g_cum)
        expected.append(st_seq)
    stacked = TreeFactors(k=torch.stack(ks), u=torch.stack(us), g_cum=torch.stack(gcs))

    commit_accepted_inplace(caches, state_indices, stacked, accepted, parent, cu)

    written = torch.zeros(buf.shape[:3], dtype=torch.bool)
    for layer in range(n_layers):
        for b, (slot, a) in enumerate(zip(state_indices.tolist(), accepted.tolist())):
            if a >= 0:
                written[slot, layer, 1] = True
                assert rel_err(buf[slot, layer, 1], expected[layer][cu_l[b] + a]) <= FP32_TOL, (layer, b)
    assert written.sum() == n_layers * 4
    assert torch.equal(buf[~written], before[~written]), "a slot that was not requested changed"


def test_public_dispatch_on_cpu_equals_reference(monkeypatch):
    monkeypatch.delenv("VLLM_BOLE_KERNELS", raising=False)
    r = run_both(MULTI_SPEC, 2, 4, 16, 8, l2norm_qk=True, scale=0.3, seed_params=("dispatch",))
    args = (r["q"], r["k"], r["v"], r["g"], r["beta"], r["s0"], r["parent"], r["cu"])
    o, f = kernels.tree_gdn_verify(*args, scale=0.3, use_qk_l2norm_in_kernel=True)
    assert torch.equal(o, r["o"])
    assert torch.equal(f.k, r["factors"].k) and torch.equal(f.u, r["factors"].u)
    assert torch.equal(f.g_cum, r["factors"].g_cum)
    assert rel_err(o, r["o_seq"]) <= FP32_TOL
    cu_l = r["cu"].tolist()
    acc = torch.tensor([(cu_l[b + 1] - cu_l[b]) // 2 for b in range(len(cu_l) - 1)], dtype=torch.int32)
    new = kernels.commit_accepted(r["s0"], f, acc, r["parent"], r["cu"])
    assert torch.equal(new, commit_accepted(r["s0"], r["factors"], acc, r["parent"], r["cu"]))
    for b, a in enumerate(acc.tolist()):
        assert rel_err(new[b], r["states_seq"][cu_l[b] + a]) <= FP32_TOL
