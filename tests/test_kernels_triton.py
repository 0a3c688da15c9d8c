"""Bole's Triton kernels against the torch references on random forests.

On a CUDA machine the kernels run compiled. Without one they run under Triton's interpreter
(``TRITON_INTERPRET=1``, set while the kernel modules are imported and during each test) at small shapes;
tests marked ``gpu`` need the real device.
"""

import random

import pytest
import torch

import vllm_bole.kernels as kernels
from sequential_gdn import build_forest, max_depth, random_gdn_inputs, rel_err, seed_of
from triton_modes import DEV, GPU, import_kernel_modules
from vllm_bole.kernels.forest import ancestor_mask
from vllm_bole.kernels.tree_conv1d import reference as conv_ref
from vllm_bole.kernels.tree_gdn import reference as gdn_ref

FP32_TOL = 1e-4
BF16_TOL = 2e-2
gpu = pytest.mark.gpu
# The interpreter converts 1-element arrays to scalars, which numpy now warns about on every kernel step.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA device")


tv, tc, tconv = import_kernel_modules("vllm_bole.kernels.tree_gdn.triton_verify",
                                      "vllm_bole.kernels.tree_gdn.triton_commit",
                                      "vllm_bole.kernels.tree_conv1d.triton_conv")


@pytest.fixture(autouse=True)
def _triton_mode(monkeypatch):
    if not GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("VLLM_BOLE_KERNELS", raising=False)


def _dev(*ts):
    return tuple(None if t is None else t.to(DEV) for t in ts)


def forest(spec, *seed_params):
    parent, cu = build_forest(spec, random.Random(seed_of("forest", spec, *seed_params)))
    return _dev(parent, cu)


def gdn_inputs(parent, cu, hk, hv, dk, dv, *, seed, dtype=torch.float32, l2norm_qk=True):
    q, k, v, g, beta, s0 = random_gdn_inputs(parent, cu, hk, hv, dk, dv, l2norm_qk=l2norm_qk, seed=seed)
    return _dev(q.to(dtype), k.to(dtype), v.to(dtype), g, beta, s0)


def check_verify(spec, hk, hv, dk, dv, *, dtype=torch.float32, l2norm_qk=True, scale=None, config=None,
                 seed_params=()):
    parent, cu = forest(spec, *seed_params)
    q, k, v, g, beta, s0 = gdn_inputs(parent, cu, hk, hv, dk, dv, dtype=dtype, l2norm_qk=l2norm_qk,
                                      seed=seed_of("inputs", spec, hk, hv, dk, dv, *seed_params))
    s0_before = s0.clone()
    o, f = tv.tree_gdn_verify(q, k, v, g, beta, s0, parent, cu, scale=scale,
                              use_qk_l2norm_in_kernel=l2norm_qk, config=config)
    assert torch.equal(s0, s0_before), "verify must not modify the committed state"
    cpu = [t.cpu() for t in (q, k, v, g, beta, s0, parent, cu)]
    o_ref, f_ref = gdn_ref.tree_gdn_verify(*cpu, scale=scale, use_qk_l2norm_in_kernel=l2norm_qk)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    assert o.dtype == v.dtype and o.shape == o_ref.shape
    for got, want in ((o, o_ref), (f.u, f_ref.u), (f.k, f_ref.k), (f.g_cum, f_ref.g_cum)):
        assert torch.isfinite(got).all()
        assert rel_err(got.cpu(), want) <= tol
    return parent, cu, f_ref


SHAPES = ("chain", "star", "kary2", "kary3", "kary4", "random", "forest", "deep")
TREE_CASES = ([("single", 1)] + [(s, t) for s in SHAPES for t in (2, 9, 40)]
              + [(s, t) for s in ("chain", "deep", "random", "kary4", "forest") for t in (64, 100, 256)])


@pytest.mark.parametrize("shape,t", TREE_CASES)
def test_verify_matches_reference(shape, t):
    parent, _, _ = check_verify([(shape, t)], 1, 2, 16, 16, seed_params=(shape, t))
    if shape in ("chain", "deep") and t >= 40:
        assert max_depth(parent.tolist()) >= 16


MULTI = [("single", 1), ("chain", 7), ("kary3", 13), ("random", 21), ("forest", 11), ("deep", 34),
         ("star", 5), ("kary2", 2)]


@pytest.mark.parametrize("hk,hv,dk,dv", [
    (1, 1, 8, 8), (2, 4, 16, 8), (3, 6, 8, 16), (1, 4, 32, 16), (2, 4, 128, 128),
    pytest.param(16, 32, 128, 128, marks=gpu),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_heads_dims_dtypes(hk, hv, dk, dv, dtype):
    if (dk >= 128 or hv >= 32) and not GPU:
        pytest.skip("large heads are slow in the Triton interpreter; run on the GPU")
    spec = MULTI if dk < 128 else MULTI + [("deep", 64), ("random", 256)]
    check_verify(spec, hk, hv, dk, dv, dtype=dtype, seed_params=("dims",))


@pytest.mark.parametrize("l2norm_qk", [True, False])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_verify_norm_and_scale(l2norm_qk, scale):
    check_verify(MULTI, 2, 4, 16, 16, l2norm_qk=l2norm_qk, scale=scale, seed_params=("norm", l2norm_qk, scale))


def test_verify_requests_of_1_to_256_nodes_and_an_empty_one():
    spec = [("single", 1), ("chain", 3), ("random", 17), ("kary4", 64), ("forest", 100), ("deep", 256)]
    check_verify(spec, 1, 2, 16, 16, seed_params=("sizes",))
    parent = torch.tensor([-1, 0, 0, -1, 0, 1], dtype=torch.int32, device=DEV)
    cu = torch.tensor([0, 3, 3, 6], dtype=torch.int32, device=DEV)
    q, k, v, g, beta, s0 = gdn_inputs(parent, cu, 1, 2, 16, 16, seed=seed_of("empty"))
    o, f = tv.tree_gdn_verify(q, k, v, g, beta, s0, parent, cu, use_qk_l2norm_in_kernel=True)
    o_ref, _ = gdn_ref.tree_gdn_verify(*[t.cpu() for t in (q, k, v, g, beta, s0, parent, cu)],
                                       use_qk_l2norm_in_kernel=True)
    assert rel_err(o.cpu(), o_ref) <= FP32_TOL


@pytest.mark.parametrize("config", [
    dict(block_t=16, block_v=16, v_splits=1, num_warps=4),    # many row tiles: off-diagonal G_rc, C_rc
    dict(block_t=32, block_v=16, v_splits=2, num_warps=4),    # value blocks split across programs
    dict(block_t=16, block_v=16, v_splits=2, num_warps=4),    # one value block per program, 16-node tiles
    dict(block_t=32, block_v=32, v_splits=1, num_warps=8, maxnreg=168),   # register cap
])
def test_verify_launch_configs(config):
    check_verify([("deep", 40), ("random", 70), ("kary2", 9)], 1, 2, 16, 32, config=config,
                 seed_params=("config",))


SPLIT_SPECS = {"small": [("kary2", 9), ("single", 1), ("chain", 16), ("star", 5)],       # one 16-row tile each
               "upto32": [("random", 30), ("deep", 32), ("kary2", 9), ("single", 1)],
               "upto64": [("deep", 64), ("random", 50), ("kary3", 40), ("single", 1)],
               "large": [("deep", 40), ("random", 70), ("forest", 33), ("single", 1)]}
SPLIT_CONFIGS = {
    "many-tiles": dict(matrices_block_t=16, block_t=16, block_v=16, num_warps=4),
    "value-tile-spans-two": dict(matrices_block_t=16, matrices_num_warps=2, block_t=32, block_v=32, num_warps=4),
    "matrix-tile-spans-two": dict(matrices_block_t=32, matrices_num_warps=2, block_t=16, block_v=16, num_warps=2),
    "one-64-tile": dict(matrices_block_t=64, matrices_num_warps=4, block_t=64, block_v=32, num_warps=4),
    "one-64-tile-regcap": dict(matrices_block_t=64, matrices_num_warps=4, block_t=64, block_v=32, num_warps=4,
                               maxnreg=128),
}


@pytest.mark.parametrize("config,spec", [(c, s) for c in SPLIT_CONFIGS for s in SPLIT_SPECS
                                         if not c.startswith("one-64-tile") or s != "large"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_split_kernels(config, spec, dtype):
    """Per-tree matrices, then value blocks: the same function as the fused kernel."""
    check_verify(SPLIT_SPECS[spec], 2, 4, 16, 32, dtype=dtype, config=SPLIT_CONFIGS[config],
                 seed_params=("split", spec))


@pytest.mark.parametrize("config,spec", [("one-64-tile", "upto64"), ("many-tiles", "small"),
                                         ("matrix-tile-spans-two", "upto32")])
@pytest.mark.parametrize("hk,hv,dk", [(1, 3, 16), (1, 4, 16), (2, 8, 32)])
def test_verify_split_key_head_groups(config, spec, hk, hv, dk):
    """The value heads of a key head store its k in equal column shares, or its first head stores all of it
    where the share would not be a power of two of at least 8."""
    check_verify(SPLIT_SPECS[spec], hk, hv, dk, 16, config=SPLIT_CONFIGS[config], seed_params=("groups", hk, hv))


# Both paths whatever launch_config would pick at these small shapes on this device.
BOTH_PATHS = {"fused": dict(block_t=16, block_v=16, v_splits=1, num_warps=4),
              "two-kernels": SPLIT_CONFIGS["many-tiles"]}


@pytest.mark.parametrize("path", BOTH_PATHS)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_verify_reads_state_slots_in_place_and_fills_given_factor_buffers(state_dtype, path):
    """As the GDN layer calls it: the whole strided state cache plus slot indices, per-forest hints
    (max_seqlen, ancestor bits) and one layer's slice of a step-wide factor buffer."""
    spec = [("random", 9), ("deep", 20), ("single", 1), ("kary2", 6)]
    parent, cu = forest(spec, "slots")
    hk, hv, dk, dv, num_slots = 1, 2, 16, 16, 7
    q, k, v, g, beta, s0 = gdn_inputs(parent, cu, hk, hv, dk, dv, seed=seed_of("slots", str(state_dtype)))
    slots = torch.tensor([5, 0, 3, 6], dtype=torch.int32, device=DEV)
    gen = torch.Generator().manual_seed(seed_of("slots-cache"))
    buf = torch.randn(num_slots, hv * dv * dk + 5, generator=gen).to(DEV)
    cache = buf[:, 3:3 + hv * dv * dk].view(num_slots, hv, dv, dk)        # padded rows: a strided view
    cache[slots.long()] = s0
    cache = cache.to(state_dtype) if state_dtype != torch.float32 else cache
    n = parent.numel()
    stacked = gdn_ref.TreeFactors(k=torch.full((3, n, hk, dk), float("nan"), device=DEV),
                                  u=torch.full((3, n, hv, dv), float("nan"), device=DEV),
                                  g_cum=torch.full((3, n, hv), float("nan"), device=DEV))
    layer = gdn_ref.TreeFactors(k=stacked.k[1], u=stacked.u[1], g_cum=stacked.g_cum[1])
    max_t = max(t for _, t in spec)
    o, f = tv.tree_gdn_verify(q, k, v, g, beta, cache, parent, cu, use_qk_l2norm_in_kernel=True,
                              state_indices=slots, max_seqlen=max_t, bits=tv.ancestor_bits(parent, cu, max_t),
                              out_factors=layer, config=BOTH_PATHS[path])
    assert f is layer
    o_ref, f_ref = gdn_ref.tree_gdn_verify(*[t.cpu() for t in (q, k, v, g, beta, cache.float(), parent, cu)],
                                           use_qk_l2norm_in_kernel=True, state_indices=slots.cpu())
    tol = FP32_TOL if state_dtype == torch.float32 else BF16_TOL
    for got, want in ((o, o_ref), (stacked.u[1], f_ref.u), (stacked.k[1], f_ref.k), (stacked.g_cum[1], f_ref.g_cum)):
        assert rel_err(got.cpu(), want) <= tol
    assert torch.isnan(stacked.u[0]).all() and torch.isnan(stacked.u[2]).all()  # other layers untouched
    # The dispatching entry point gives the same on any device, the reference path filling the buffers too.
    again = gdn_ref.TreeFactors(*(torch.empty_like(t) for t in (layer.k, layer.u, layer.g_cum)))
    o2, _ = kernels.tree_gdn_verify(q, k, v, g, beta, cache, parent, cu, use_qk_l2norm_in_kernel=True,
                                    state_indices=slots, out_factors=again)
    assert rel_err(o2.cpu(), o_ref) <= tol and rel_err(again.u.cpu(), f_ref.u) <= tol


@pytest.mark.parametrize("t", [1, 31, 32, 33, 200, 300])
def test_ancestor_bits_match_mask(t):
    spec = [("random", t), ("forest", max(1, t // 3)), ("deep", t)]
    parent, cu = forest(spec, "bits")
    max_t = max(s for _, s in spec)
    bits = tv.ancestor_bits(parent, cu, max_t).cpu()
    cu_l = cu.tolist()
    for b in range(len(cu_l) - 1):
        s, e = cu_l[b], cu_l[b + 1]
        mask = ancestor_mask(parent[s:e].cpu())
        j = torch.arange(e - s)
        got = ((bits[s:e][:, j // 32] >> (j % 32)) & 1).bool()
        assert torch.equal(got, mask)


# --------------------------------------------------------------------------------------------------------
# Factored-state commit
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec_name", ["multi", "deep"])
def test_commit_every_accepted_node(spec_name):
    spec = MULTI if spec_name == "multi" else [("deep", 64), ("chain", 20)]
    parent, cu, f_ref = check_verify(spec, 2, 4, 16, 16, seed_params=("commit", spec_name))
    _, _, _, _, _, s0 = gdn_inputs(parent, cu, 2, 4, 16, 16, seed=seed_of("inputs", spec, 2, 4, 16, 16,
                                                                          "commit", spec_name))
    factors = gdn_ref.TreeFactors(*_dev(f_ref.k, f_ref.u, f_ref.g_cum))
    sizes = (cu[1:] - cu[:-1]).tolist()
    for i in range(-1, max(sizes)):
        accepted = torch.tensor([i if i < s else -1 for s in sizes], dtype=torch.int32, device=DEV)
        new = tc.commit_accepted(s0, factors, accepted, parent, cu)
        want = gdn_ref.commit_accepted(s0.cpu(), f_ref, accepted.cpu(), parent.cpu(), cu.cpu())
        assert rel_err(new.cpu(), want) <= 1e-5, i


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_layer_slots", [False, True])
def test_commit_inplace_multilayer_strided_caches(state_dtype, per_layer_slots):
    spec = [("random", 9), ("deep", 20), ("single", 1), ("kary2", 6)]
    parent, cu = forest(spec, "inplace")
    hk, hv, dk, dv, n_layers, num_slots = 1, 2, 16, 16, 3, 7
    gen = torch.Generator().manual_seed(seed_of("inplace"))
    # One padded buffer holding every layer: each cache is a strided, non-contiguous view.
    buf = torch.randn(num_slots, n_layers, hv * dv * dk + 5, generator=gen).to(state_dtype).to(DEV)
    caches = [buf[:, layer, 3:3 + hv * dv * dk].view(num_slots, hv, dv, dk) for layer in range(n_layers)]
    fs = []
    for layer in range(n_layers):
        q, k, v, g, beta, _ = gdn_inputs(parent, cu, hk, hv, dk, dv, seed=seed_of("inplace", layer))
        fs.append(gdn_ref.tree_gdn_verify(q, k, v, g, beta, torch.zeros(4, hv, dv, dk, device=DEV), parent, cu,
                                          use_qk_l2norm_in_kernel=True)[1])
    stacked = gdn_ref.TreeFactors(*(torch.stack([getattr(f, a) for f in fs]) for a in ("k", "u", "g_cum")))
    state_indices = torch.tensor([5, 0, 3, 6], dtype=torch.int32, device=DEV)
    if per_layer_slots:  # layers in different KV-cache groups: same requests, other slots per layer
        state_indices = torch.stack([state_indices, torch.tensor([5, 0, 3, 6], dtype=torch.int32, device=DEV),
                                     torch.tensor([6, 3, 1, 5], dtype=torch.int32, device=DEV)])
    accepted = torch.tensor([8, 19, -1, 4], dtype=torch.int32, device=DEV)
    want_buf = buf.clone()
    want = [want_buf[:, layer, 3:3 + hv * dv * dk].view(num_slots, hv, dv, dk) for layer in range(n_layers)]
    gdn_ref.commit_accepted_inplace(want, state_indices, stacked, accepted, parent, cu)
    tc.commit_accepted_inplace(caches, state_indices, stacked, accepted, parent, cu)
    tol = 1e-5 if state_dtype == torch.float32 else 1e-2
    assert rel_err(buf.cpu(), want_buf.cpu()) <= tol
    untouched = torch.ones(num_slots, n_layers, dtype=torch.bool)
    for layer in range(n_layers):
        slots = state_indices[layer] if per_layer_slots else state_indices
        untouched[[int(slots[b]) for b in (0, 1, 3)], layer] = False
    assert torch.equal(buf[untouched.to(DEV)], want_buf[untouched.to(DEV)])
    assert torch.equal(buf[..., :3], want_buf[..., :3]) and torch.equal(buf[..., -2:], want_buf[..., -2:])


# --------------------------------------------------------------------------------------------------------
# Tree conv1d
# --------------------------------------------------------------------------------------------------------
def conv_inputs(spec, dim, width, *seed_params, dtype=torch.float32, state_dtype=None, with_bias=True):
    parent, cu = forest(spec, *seed_params)
    gen = torch.Generator().manual_seed(seed_of("conv", spec, dim, width, *seed_params))
    x = torch.randn(parent.numel(), dim, generator=gen).to(dtype)
    weight = (torch.randn(dim, width, generator=gen) / width ** 0.5).to(dtype)
    bias = (0.3 * torch.randn(dim, generator=gen)).to(dtype) if with_bias else None
    # A strided view, as vLLM's per-layer conv caches are.
    state = torch.randn(cu.numel() - 1, width + 2, dim, generator=gen).to(state_dtype or dtype)
    return parent, cu, *_dev(x, weight, bias, state[:, 1:width].transpose(1, 2))


CONV_SPECS = {"multi": MULTI, "chain": [("chain", 12)], "deep": [("deep", 256)], "forest": [("forest", 40)],
              "kary4": [("kary4", 100)], "single": [("single", 1)]}


@pytest.mark.parametrize("name", list(CONV_SPECS))
@pytest.mark.parametrize("width", [2, 3, 4])
def test_conv_matches_reference(name, width):
    parent, cu, x, w, bias, state = conv_inputs(CONV_SPECS[name], 40, width, name)
    out = tconv.tree_causal_conv1d(x, w, bias, state, parent, cu)
    want = conv_ref.tree_causal_conv1d(*[t.cpu() for t in (x, w, bias, state, parent, cu)])
    assert torch.isfinite(out).all() and rel_err(out.cpu(), want) <= FP32_TOL


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("activation", ["silu", None])
def test_conv_bias_and_activation(with_bias, activation):
    parent, cu, x, w, bias, state = conv_inputs(MULTI, 300, 4, "act", with_bias=with_bias)
    out = tconv.tree_causal_conv1d(x, w, bias, state, parent, cu, activation=activation)
    want = conv_ref.tree_causal_conv1d(*[None if t is None else t.cpu() for t in (x, w, bias, state, parent, cu)],
                                       activation=activation)
    assert rel_err(out.cpu(), want) <= FP32_TOL


def test_conv_bf16_inputs_fp32_state():
    parent, cu, x, w, bias, state = conv_inputs(MULTI, 64, 4, "bf16", dtype=torch.bfloat16,
                                                state_dtype=torch.float32)
    out = tconv.tree_causal_conv1d(x, w, bias, state, parent, cu)
    want = conv_ref.tree_causal_conv1d(*[t.cpu() for t in (x, w, bias, state, parent, cu)])
    assert out.dtype == torch.bfloat16 and rel_err(out.cpu(), want) <= BF16_TOL
    acc = torch.tensor([0, 6, 12, 20, 10, 33, 4, 1], dtype=torch.int32, device=DEV)
    new = tconv.commit_conv_state(state, x, parent, cu, acc)
    assert torch.equal(new.cpu(), conv_ref.commit_conv_state(state.cpu(), x.cpu(), parent.cpu(), cu.cpu(),
                                                             acc.cpu()))


@pytest.mark.parametrize("name", ["multi", "deep", "forest"])
@pytest.mark.parametrize("width", [2, 4])
def test_conv_commit_every_accepted_node(name, width):
    parent, cu, x, w, bias, state = conv_inputs(CONV_SPECS[name], 24, width, "commit", name)
    sizes = (cu[1:] - cu[:-1]).tolist()
    nodes = range(-1, max(sizes)) if max(sizes) <= 64 else [-1, 0, 1, 2, 3, 17, 100, 254, 255]
    for i in nodes:
        acc = torch.tensor([i if i < s else -1 for s in sizes], dtype=torch.int32, device=DEV)
        new = tconv.commit_conv_state(state, x, parent, cu, acc)
        want = conv_ref.commit_conv_state(state.cpu(), x.cpu(), parent.cpu(), cu.cpu(), acc.cpu())
        assert torch.equal(new.cpu(), want), i


@pytest.mark.parametrize("per_layer_slots", [False, True])
def test_conv_commit_inplace_multilayer_transposed_views(per_layer_slots):
    spec = [("random", 9), ("deep", 20), ("single", 1), ("kary2", 6)]
    parent, cu = forest(spec, "conv-inplace")
    dim, width, n_layers, num_slots = 40, 4, 3, 6
    gen = torch.Generator().manual_seed(seed_of("conv-inplace"))
    buf = torch.randn(num_slots, n_layers, width - 1, dim + 2, generator=gen).to(DEV)
    views = lambda b: [b[:, layer, :, 1:dim + 1].transpose(-1, -2) for layer in range(n_layers)]  # noqa: E731
    xs = torch.randn(n_layers, parent.numel(), dim, generator=gen).to(DEV)
    state_indices = torch.tensor([4, 1, 0, 5], dtype=torch.int32, device=DEV)
    if per_layer_slots:
        state_indices = torch.stack([state_indices, torch.tensor([2, 3, 1, 0], dtype=torch.int32, device=DEV),
                                     torch.tensor([0, 5, 4, 1], dtype=torch.int32, device=DEV)])
    accepted = torch.tensor([3, 19, 0, -1], dtype=torch.int32, device=DEV)
    want = buf.clone()
    conv_ref.commit_conv_state_inplace(views(want), state_indices, xs, parent, cu, accepted)
    tconv.commit_conv_state_inplace(views(buf), state_indices, xs, parent, cu, accepted)
    assert torch.equal(buf, want)


# --------------------------------------------------------------------------------------------------------
# GPU only: public dispatch, and vLLM's own GDN kernel on chains
# --------------------------------------------------------------------------------------------------------
@needs_gpu
def test_public_dispatch_runs_triton_on_cuda(monkeypatch):
    parent, cu = forest(MULTI, "dispatch")
    q, k, v, g, beta, s0 = gdn_inputs(parent, cu, 2, 4, 32, 32, seed=seed_of("dispatch"))
    o, f = kernels.tree_gdn_verify(q, k, v, g, beta, s0, parent, cu, use_qk_l2norm_in_kernel=True)
    o_tr, _ = tv.tree_gdn_verify(q, k, v, g, beta, s0, parent, cu, use_qk_l2norm_in_kernel=True)
    assert torch.equal(o, o_tr)
    monkeypatch.setenv("VLLM_BOLE_KERNELS", "reference")
    o_ref, _ = kernels.tree_gdn_verify(q, k, v, g, beta, s0, parent, cu, use_qk_l2norm_in_kernel=True)
    assert rel_err(o, o_ref) <= FP32_TOL


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chain_matches_vllm_fused_recurrent(dtype):
    """A forest of chains is token-by-token decoding: outputs and per-token states must equal vLLM's GDN
    kernel (``fused_recurrent_gated_delta_rule``) at Qwen3.5 head shapes."""
    import vllm_fla

    fla = vllm_fla.load("fused_recurrent")
    if fla is None:
        pytest.skip("vLLM's FLA kernels are unavailable: install vLLM or set BOLE_VLLM_FLA_DIR")
    spec = [("chain", 1), ("chain", 7), ("chain", 64), ("chain", 200)]
    hk, hv, dk, dv = 16, 32, 128, 128
    parent, cu = forest(spec, "vllm")
    q, k, v, g, beta, s0 = gdn_inputs(parent, cu, hk, hv, dk, dv, dtype=dtype, seed=seed_of("vllm", dtype))
    o, f = tv.tree_gdn_verify(q, k, v, g, beta, s0, parent, cu, use_qk_l2norm_in_kernel=True)

    # vLLM spec decoding keeps one state slot per token; slot 0 is its null block.
    n, sizes = parent.numel(), (cu[1:] - cu[:-1]).tolist()
    cache = torch.zeros(1 + n, hv, dv, dk, device=DEV)
    slots = torch.zeros(len(sizes), max(sizes), dtype=torch.int32, device=DEV)
    for b, s in enumerate(cu[:-1].tolist()):
        slots[b, :sizes[b]] = torch.arange(1 + s, 1 + s + sizes[b], device=DEV)
        cache[1 + s] = s0[b]
    o_vllm, _ = fla.fused_recurrent_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], initial_state=cache, inplace_final_state=True,
        cu_seqlens=cu, ssm_state_indices=slots, use_qk_l2norm_in_kernel=True)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    assert rel_err(o, o_vllm[0]) <= tol
    for i in (0, 3, 63, 199):
        accepted = torch.tensor([min(i, s - 1) for s in sizes], dtype=torch.int32, device=DEV)
        new = tc.commit_accepted(s0, f, accepted, parent, cu)
        want = cache[1 + cu[:-1].long() + accepted.long()]
        assert rel_err(new, want) <= tol, i


# --------------------------------------------------------------------------------------------------------
# Padded forests, as the full CUDA graphs run them: padding rows after the last tree, empty requests after the
# last request (cu_seqlens repeats its last value), capacity bounds instead of the largest tree
# --------------------------------------------------------------------------------------------------------
def _padded(parent, cu, extra_rows, extra_reqs):
    pad_parent = torch.cat([parent, torch.full((extra_rows,), -1, dtype=parent.dtype, device=parent.device)])
    pad_cu = torch.cat([cu, cu[-1:].expand(extra_reqs)])
    return pad_parent, pad_cu


@pytest.mark.parametrize("path", BOTH_PATHS)
def test_verify_on_a_padded_forest_matches_the_reference_on_the_real_one(path):
    spec = [("random", 9), ("deep", 20), ("single", 1)]
    parent, cu = forest(spec, "padded")
    hk, hv, dk, dv, extra_rows, extra_reqs = 1, 2, 16, 16, 6, 3
    q, k, v, g, beta, s0 = gdn_inputs(parent, cu, hk, hv, dk, dv, seed=seed_of("padded"))
    n, b = parent.numel(), cu.numel() - 1
    gen = torch.Generator().manual_seed(seed_of("padded-rows"))

    def pad_rows(t):
        return torch.cat([t, torch.randn(extra_rows, *t.shape[1:], generator=gen).to(t.dtype).to(DEV)])

    p_parent, p_cu = _padded(parent, cu, extra_rows, extra_reqs)
    cache = torch.cat([s0, torch.randn(2, *s0.shape[1:], generator=gen).to(DEV)])      # 2 spare slots
    slots = torch.tensor(list(range(b)) + [b, b + 1, b], dtype=torch.int32, device=DEV)
    bound = 40                                                                          # > every tree
    o, f = tv.tree_gdn_verify(pad_rows(q), pad_rows(k), pad_rows(v), pad_rows(g), pad_rows(beta), cache,
                              p_parent, p_cu, use_qk_l2norm_in_kernel=True, state_indices=slots, max_seqlen=bound,
                              bits=tv.ancestor_bits(p_parent, p_cu, bound), config=BOTH_PATHS[path])
    o_ref, f_ref = gdn_ref.tree_gdn_verify(*[t.cpu() for t in (q, k, v, g, beta, s0, parent, cu)],
                                           use_qk_l2norm_in_kernel=True)
    for got, want in ((o[:n], o_ref), (f.u[:n], f_ref.u), (f.k[:n], f_ref.k), (f.g_cum[:n], f_ref.g_cum)):
        assert rel_err(got.cpu(), want) <= FP32_TOL


def test_conv_and_bits_on_a_padded_forest_equal_the_real_ones():
    parent, cu, x, w, bias, state = conv_inputs(MULTI, 40, 4, "padded")
    n, b = parent.numel(), cu.numel() - 1
    p_parent, p_cu = _padded(parent, cu, 5, 4)
    gen = torch.Generator().manual_seed(seed_of("padded-conv"))
    p_x = torch.cat([x, torch.randn(5, x.shape[1], generator=gen).to(DEV)])
    p_state = torch.cat([state, torch.randn(4, *state.shape[1:], generator=gen).to(DEV)])
    out = tconv.tree_causal_conv1d(x, w, bias, state, parent, cu)
    p_out = tconv.tree_causal_conv1d(p_x, w, bias, p_state, p_parent, p_cu)
    assert torch.equal(p_out[:n], out)
    max_t = int((cu[1:] - cu[:-1]).max())
    bits, p_bits = tv.ancestor_bits(parent, cu, max_t), tv.ancestor_bits(p_parent, p_cu, 70)
    assert torch.equal(p_bits[:n, :bits.shape[1]], bits) and not p_bits[:n, bits.shape[1]:].any()
    assert b == len(MULTI)


@pytest.mark.parametrize("path", BOTH_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_takes_views_of_a_packed_conv_output_and_writes_into_out(path, dtype):
    """As the GDN layer calls it: q, k, v are column slices of one ``[N, conv_dim]`` tensor (row stride
    conv_dim) and the output goes into the layer's own buffer."""
    spec = [("random", 9), ("deep", 20), ("single", 1), ("kary2", 6)]
    parent, cu = forest(spec, "views")
    hk, hv, dk, dv = 2, 4, 16, 16
    q, k, v, g, beta, s0 = gdn_inputs(parent, cu, hk, hv, dk, dv, dtype=dtype, seed=seed_of("views", str(dtype)))
    n = parent.numel()
    packed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=1)
    kd = hk * dk
    qv, kv, vv = (packed[:, :kd].view(n, hk, dk), packed[:, kd:2 * kd].view(n, hk, dk),
                  packed[:, 2 * kd:].view(n, hv, dv))
    assert not qv.is_contiguous() and qv.stride(0) == packed.shape[1]
    out = torch.full((n, hv, dv), float("nan"), dtype=dtype, device=DEV)
    o, f = tv.tree_gdn_verify(qv, kv, vv, g, beta, s0, parent, cu, use_qk_l2norm_in_kernel=True, out=out,
                              config=BOTH_PATHS[path])
    assert o.data_ptr() == out.data_ptr()
    o_ref, f_ref = gdn_ref.tree_gdn_verify(*[t.cpu() for t in (q, k, v, g, beta, s0, parent, cu)],
                                           use_qk_l2norm_in_kernel=True)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    assert torch.isfinite(out).all() and rel_err(out.cpu(), o_ref) <= tol and rel_err(f.u.cpu(), f_ref.u) <= tol
    # The dispatching entry point fills ``out`` on the reference path too.
    out2 = torch.empty_like(out)
    o2, _ = kernels.tree_gdn_verify(qv, kv, vv, g, beta, s0, parent, cu, use_qk_l2norm_in_kernel=True, out=out2)
    assert o2.data_ptr() == out2.data_ptr() and rel_err(out2.cpu(), o_ref) <= tol


@pytest.mark.parametrize("name", ["multi", "deep", "single"])
def test_conv_reads_cache_rows_by_slot_and_keeps_a_copy_of_its_input(name):
    """As the GDN layer calls it: the whole strided conv cache plus slot indices, and a buffer (one layer's
    rows of the step's conv inputs) that receives x for the commit."""
    parent, cu, x, w, bias, state = conv_inputs(CONV_SPECS[name], 40, 4, f"slots-{name}")
    batch, num_slots = cu.numel() - 1, cu.numel() + 4
    gen = torch.Generator().manual_seed(seed_of("conv-slots", name))
    slots = torch.randperm(num_slots, generator=gen)[:batch].to(torch.int32).to(DEV)
    cache = torch.randn(num_slots, state.shape[2] + 2, state.shape[1], generator=gen).to(DEV)
    cache = cache[:, 1:state.shape[2] + 1].transpose(1, 2)                       # strided, as vLLM's views
    cache[slots.long()] = state
    layers = torch.full((3, *x.shape), float("nan"), dtype=x.dtype, device=DEV)
    out = tconv.tree_causal_conv1d(x, w, bias, cache, parent, cu, state_indices=slots, x_copy=layers[1])
    want = conv_ref.tree_causal_conv1d(*[t.cpu() for t in (x, w, bias, state, parent, cu)])
    assert torch.isfinite(out).all() and rel_err(out.cpu(), want) <= FP32_TOL
    assert torch.equal(layers[1], x) and torch.isnan(layers[0]).all() and torch.isnan(layers[2]).all()
    # The dispatching entry point and the reference take the same arguments.
    copy = torch.empty_like(x)
    out2 = kernels.tree_causal_conv1d(x, w, bias, cache, parent, cu, state_indices=slots, x_copy=copy)
    assert rel_err(out2.cpu(), want) <= FP32_TOL and torch.equal(copy, x)
    copy_ref = torch.empty_like(x).cpu()
    out3 = conv_ref.tree_causal_conv1d(*[t.cpu() for t in (x, w, bias, cache, parent, cu)],
                                       state_indices=slots.cpu(), x_copy=copy_ref)
    assert torch.equal(out3, want) and torch.equal(copy_ref, x.cpu())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1, 5, 37])
def test_gdn_gates_read_strided_projections(dtype, n):
    """The gates from ``b, a = ba.chunk(2, dim=-1)`` (column halves, row stride 2H), against the reference,
    including softplus's linear branch (a + dt_bias above 20) and beta rounded to the input dtype."""
    from vllm_bole.kernels.tree_gdn.triton_gates import gdn_gates as triton_gates

    h = 12
    gen = torch.Generator().manual_seed(seed_of("gates", str(dtype), n))
    ba = (4 * torch.randn(n, 2 * h, generator=gen)).to(dtype)
    ba[0, h + 1] = 30.0                                   # softplus past its threshold
    b, a = ba.to(DEV).chunk(2, dim=-1)
    A_log = torch.randn(h, generator=gen).to(DEV)
    dt_bias = torch.randn(h, generator=gen).to(DEV)
    g, beta = triton_gates(a, b, A_log, dt_bias)
    g_ref, beta_ref = gdn_ref.gdn_gates(a.cpu(), b.cpu(), A_log.cpu(), dt_bias.cpu())
    assert g.dtype == beta.dtype == torch.float32 and g.shape == beta.shape == (n, h)
    # Triton's interpreter truncates to bf16 where the GPU rounds to nearest: one bf16 step apart at most there.
    beta_tol = dict(rtol=2 ** -7, atol=0) if dtype == torch.bfloat16 and not GPU else dict(rtol=0, atol=1e-6)
    assert torch.allclose(g.cpu(), g_ref, rtol=1e-6, atol=1e-6) and torch.allclose(beta.cpu(), beta_ref, **beta_tol)
    assert torch.equal(beta.cpu().to(dtype).float(), beta.cpu())          # rounded to the input dtype
    g2, beta2 = kernels.gdn_gates(a, b, A_log, dt_bias)
    assert torch.allclose(g2.cpu(), g_ref, rtol=1e-6, atol=1e-6) and torch.allclose(beta2.cpu(), beta_ref, **beta_tol)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gdn_gates_equal_vllms_gating(dtype):
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import fused_gdn_gating

    from vllm_bole.kernels.tree_gdn.triton_gates import gdn_gates as triton_gates

    gen = torch.Generator().manual_seed(seed_of("gates-vllm", str(dtype)))
    ba = (4 * torch.randn(64, 64, generator=gen)).to(dtype).to(DEV)
    b, a = ba.chunk(2, dim=-1)
    A_log, dt_bias = torch.randn(32, generator=gen).to(DEV), torch.randn(32, generator=gen).to(DEV)
    g, beta = triton_gates(a, b, A_log, dt_bias)
    g_v, beta_v = fused_gdn_gating(A_log, a.contiguous(), b.contiguous(), dt_bias)
    assert torch.equal(g, g_v.reshape(64, 32).float()) and torch.equal(beta, beta_v.reshape(64, 32).float())
