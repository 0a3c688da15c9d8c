"""The tree causal conv1d reference and its conv-state commit against a per-node sequential conv."""

import random

import pytest
import torch

import vllm_bole.kernels as kernels
from sequential_gdn import NAMED_SPECS, build_forest, max_depth, rel_err, seed_of, sequential_tree_conv1d
from vllm_bole.kernels.forest import node_depths
from vllm_bole.kernels.tree_conv1d.reference import (
    commit_conv_state,
    commit_conv_state_inplace,
    tree_causal_conv1d,
)

FP32_TOL = 1e-4
BF16_TOL = 2e-2


def make_inputs(n, b, dim, width, *, seed, with_bias=True, dtype=torch.float32, state_dtype=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=gen).to(dtype)
    weight = (torch.randn(dim, width, generator=gen) / width ** 0.5).to(dtype)
    bias = (0.3 * torch.randn(dim, generator=gen)).to(dtype) if with_bias else None
    conv_state = torch.randn(b, dim, width - 1, generator=gen).to(state_dtype or dtype)
    return x, weight, bias, conv_state


def setup(spec, dim, width, *, seed_params, **kw):
    rng = random.Random(seed_of("forest", spec, *seed_params))
    parent, cu = build_forest(spec, rng)
    x, weight, bias, conv_state = make_inputs(parent.numel(), cu.numel() - 1, dim, width,
                                              seed=seed_of("inputs", spec, dim, width, *seed_params), **kw)
    return parent, cu, x, weight, bias, conv_state


def sizes_of(cu):
    cu_l = cu.tolist()
    return [cu_l[b + 1] - cu_l[b] for b in range(len(cu_l) - 1)]


@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("name", list(NAMED_SPECS))
def test_conv_matches_sequential(name, width):
    spec = NAMED_SPECS[name]
    parent, cu, x, weight, bias, conv_state = setup(spec, 6, width, seed_params=(name,))
    state_before = conv_state.clone()
    out = tree_causal_conv1d(x, weight, bias, conv_state, parent, cu, activation="silu")
    assert torch.equal(conv_state, state_before), "the forward must not touch the conv state"
    expected, _ = sequential_tree_conv1d(x, weight, bias, conv_state, parent, cu, activation="silu")
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_err(out, expected) <= FP32_TOL


@pytest.mark.parametrize("activation", [None, "silu", "swish"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_conv_bias_and_activation(with_bias, activation):
    spec = NAMED_SPECS["multi"]
    parent, cu, x, weight, bias, conv_state = setup(spec, 8, 4, seed_params=("act", with_bias, activation),
                                                    with_bias=with_bias)
    assert (bias is None) == (not with_bias)
    out = tree_causal_conv1d(x, weight, bias, conv_state, parent, cu, activation=activation)
    expected, _ = sequential_tree_conv1d(x, weight, bias, conv_state, parent, cu, activation=activation)
    assert rel_err(out, expected) <= FP32_TOL
    if activation is None:
        # Linear: with no bias the conv of -x (and -state) is exactly the negation.
        out_neg = tree_causal_conv1d(-x, weight, None, -conv_state, parent, cu, activation=None)
        out_nb = tree_causal_conv1d(x, weight, None, conv_state, parent, cu, activation=None)
        assert torch.allclose(out_neg, -out_nb, atol=1e-6)
    else:
        lin, _ = sequential_tree_conv1d(x, weight, bias, conv_state, parent, cu, activation=None)
        assert rel_err(out, lin) > 1e-2  # the activation really is applied


def test_bad_activation_raises():
    parent, cu, x, weight, bias, conv_state = setup([("chain", 3)], 4, 4, seed_params=("bad",))
    with pytest.raises(ValueError, match="activation"):
        tree_causal_conv1d(x, weight, bias, conv_state, parent, cu, activation="relu")


@pytest.mark.parametrize("shape", ["chain", "deep", "random", "kary4"])
@pytest.mark.parametrize("t", [128, 256])
def test_conv_large_trees(shape, t):
    parent, cu, x, weight, bias, conv_state = setup([(shape, t)], 3, 4, seed_params=("large", shape, t))
    if shape in ("chain", "deep"):
        assert max_depth(parent.tolist()) >= 16
    out = tree_causal_conv1d(x, weight, bias, conv_state, parent, cu)
    expected, windows = sequential_tree_conv1d(x, weight, bias, conv_state, parent, cu)
    assert rel_err(out, expected) <= FP32_TOL
    new = commit_conv_state(conv_state, x, parent, cu, torch.tensor([t - 1]))
    assert torch.equal(new[0], windows[t - 1].float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ["chain", "star", "random", "multi"])
def test_conv_is_bitwise_one_depthwise_conv_per_window(name, dtype):
    """The reference's one strided conv over the windows laid end to end gives, bit for bit, what a depthwise
    ``F.conv1d`` over each node's own window gives (the per-token computation of vLLM's CPU conv)."""
    import torch.nn.functional as F

    from vllm_bole.kernels.tree_conv1d.reference import tree_windows

    parent, cu, x, weight, bias, conv_state = setup(NAMED_SPECS[name], 96, 4, seed_params=(name, str(dtype)),
                                                    dtype=dtype)
    out = tree_causal_conv1d(x, weight, bias, conv_state, parent, cu, activation=None)
    win = tree_windows(x, conv_state, parent, cu, 4).to(weight.dtype)
    per_window = F.conv1d(win, weight.unsqueeze(1), bias, groups=x.shape[1])[..., 0]
    assert torch.equal(out, per_window.to(x.dtype))


def test_chain_matches_vllm_causal_conv1d():
    """On chains the tree conv is vLLM's own causal conv (torch CPU path), and the commit its state update."""
    from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_torch

    spec = [("chain", 1), ("chain", 2), ("chain", 3), ("chain", 9), ("chain", 17)]
    dim, width = 8, 4
    parent, cu, x, weight, bias, conv_state = setup(spec, dim, width, seed_params=("vllm",))
    out = tree_causal_conv1d(x, weight, bias, conv_state, parent, cu, activation="silu")
    last = torch.tensor([t - 1 for t in sizes_of(cu)])
    new = commit_conv_state(conv_state, x, parent, cu, last)

    states = conv_state.clone()
    b = cu.numel() - 1
    out_vllm = causal_conv1d_torch(
        x.transpose(0, 1).contiguous(), weight, bias, states, cu, torch.arange(b), torch.ones(b, dtype=torch.bool),
        activation="silu").transpose(0, 1)
    assert rel_err(out, out_vllm) <= 1e-5
    assert torch.equal(new, states)


def test_windows_cross_into_committed_state_only_for_shallow_nodes():
    """Nodes of depth < W-1 read the committed conv state; deeper nodes read only tree inputs."""
    width = 4
    spec = [("deep", 40), ("kary2", 15), ("forest", 12)]
    parent, cu, x, weight, bias, conv_state = setup(spec, 5, width, seed_params=("cross",))
    depth = node_depths(parent, cu)
    shallow = depth < width - 1
    assert shallow.any() and (~shallow).any()
    out_a = tree_causal_conv1d(x, weight, bias, conv_state, parent, cu)
    other_state = conv_state + 1.0 + torch.rand(conv_state.shape, generator=torch.Generator().manual_seed(7))
    out_b = tree_causal_conv1d(x, weight, bias, other_state, parent, cu)
    assert torch.equal(out_a[~shallow], out_b[~shallow])
    assert ((out_a[shallow] - out_b[shallow]).abs().amax(-1) > 0).all()
    for state, out in ((conv_state, out_a), (other_state, out_b)):
        expected, _ = sequential_tree_conv1d(x, weight, bias, state, parent, cu)
        assert rel_err(out, expected) <= FP32_TOL
    # A node at depth d < W-1 reads exactly the W-1-d most recent committed entries: perturbing the
    # older ones changes nothing.
    for d in range(width - 1):
        keep = width - 1 - d
        older = conv_state.clone()
        older[..., : width - 1 - keep] += 5.0
        out_c = tree_causal_conv1d(x, weight, bias, older, parent, cu)
        assert torch.equal(out_c[depth == d], out_a[depth == d])


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("name", ["single", "chain", "star", "kary2", "kary4", "random", "forest", "deep", "multi"])
def test_commit_every_accepted_node(name, width):
    """Committing node a keeps the last W-1 inputs along root..a (older ones from the committed state)."""
    spec = NAMED_SPECS[name]
    parent, cu, x, weight, bias, conv_state = setup(spec, 5, width, seed_params=("commit", name))
    _, windows = sequential_tree_conv1d(x, weight, bias, conv_state, parent, cu)
    sizes, cu_l = sizes_of(cu), cu.tolist()
    before = conv_state.clone()
    for a in range(max(sizes)):
        accepted = torch.tensor([a if a < t else -1 for t in sizes], dtype=torch.int32)
        new = commit_conv_state(conv_state, x, parent, cu, accepted)
        assert new.shape == conv_state.shape and new.dtype == conv_state.dtype
        for b, t in enumerate(sizes):
            if a < t:
                assert torch.equal(new[b], windows[cu_l[b] + a].float()), (b, a)
                assert torch.equal(new[b][:, -1], x[cu_l[b] + a])   # most recent entry: the accepted input
            else:
                assert torch.equal(new[b], conv_state[b])
    none = commit_conv_state(conv_state, x, parent, cu, torch.full((len(sizes),), -1))
    assert torch.equal(none, conv_state) and torch.equal(conv_state, before)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_commit_keeps_state_dtype_exactly(state_dtype):
    """bf16 conv inputs with a float32 (or bf16) conv state: a commit copies values, it never rounds the
    committed entries through the input dtype."""
    width = 4
    spec = [("chain", 1), ("chain", 2), ("random", 12), ("deep", 32)]
    parent, cu, x, weight, bias, conv_state = setup(spec, 6, width, seed_params=("dtype", str(state_dtype)),
                                                    dtype=torch.bfloat16, state_dtype=state_dtype)
    _, windows = sequential_tree_conv1d(x, weight, bias, conv_state, parent, cu)
    sizes, cu_l = sizes_of(cu), cu.tolist()
    for a in range(max(sizes)):
        accepted = torch.tensor([a if a < t else -1 for t in sizes])
        new = commit_conv_state(conv_state, x, parent, cu, accepted)
        assert new.dtype == state_dtype
        for b, t in enumerate(sizes):
            if a < t:
                assert torch.equal(new[b], windows[cu_l[b] + a].to(state_dtype)), (b, a)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_bf16_inputs(state_dtype):
    spec = NAMED_SPECS["multi"]
    parent, cu, x, weight, bias, conv_state = setup(spec, 16, 4, seed_params=("bf16", str(state_dtype)),
                                                    dtype=torch.bfloat16, state_dtype=state_dtype)
    out = tree_causal_conv1d(x, weight, bias, conv_state, parent, cu)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    expected, _ = sequential_tree_conv1d(x, weight, bias, conv_state, parent, cu, dtype=torch.float32)
    assert rel_err(out, expected) <= BF16_TOL


def test_commit_inplace_multilayer_transposed_views():
    """vLLM may hand the conv cache as a transposed view of a [slots, W-1, dim] buffer: the multi-layer
    commit writes exactly the requested (layer, slot) windows and nothing else."""
    n_layers, num_slots, dim, width = 3, 8, 6, 4
    spec = [("random", 10), ("deep", 32), ("single", 1), ("kary2", 7), ("forest", 9)]
    rng = random.Random(seed_of("conv-inplace"))
    parent, cu = build_forest(spec, rng)
    cu_l = cu.tolist()
    state_indices = torch.tensor([5, 1, 7, 0, 3], dtype=torch.int32)
    accepted = torch.tensor([9, 20, 0, -1, 2], dtype=torch.int32)
    gen = torch.Generator().manual_seed(seed_of("conv-inplace-buf"))
    buf = torch.randn(num_slots, n_layers, width - 1, dim + 2, generator=gen)   # padded rows, shared buffer
    caches = [buf[:, layer, :, 1:dim + 1].transpose(-1, -2) for layer in range(n_layers)]
    assert caches[0].shape == (num_slots, dim, width - 1) and not caches[0].is_contiguous()
    before = buf.clone()
    xs = torch.randn(n_layers, parent.numel(), dim, generator=gen)
    weight = torch.randn(dim, width, generator=gen)
    expected = []
    for layer in range(n_layers):
        s0 = caches[layer][state_indices.long()].clone()
        expected.append(sequential_tree_conv1d(xs[layer], weight, None, s0, parent, cu)[1])

    commit_conv_state_inplace(caches, state_indices, xs, parent, cu, accepted)

    written = torch.zeros(buf.shape, dtype=torch.bool)
    for layer in range(n_layers):
        for b, (slot, a) in enumerate(zip(state_indices.tolist(), accepted.tolist())):
            if a >= 0:
                written[slot, layer, :, 1:dim + 1] = True
                assert torch.equal(caches[layer][slot], expected[layer][cu_l[b] + a].float()), (layer, b)
    assert written.sum() == n_layers * 4 * (width - 1) * dim
    assert torch.equal(buf[~written], before[~written]), "an entry outside the requested windows changed"


def test_public_dispatch_on_cpu_equals_reference(monkeypatch):
    monkeypatch.delenv("VLLM_BOLE_KERNELS", raising=False)
    spec = NAMED_SPECS["multi"]
    parent, cu, x, weight, bias, conv_state = setup(spec, 6, 4, seed_params=("dispatch",))
    out = kernels.tree_causal_conv1d(x, weight, bias, conv_state, parent, cu, activation="silu")
    assert torch.equal(out, tree_causal_conv1d(x, weight, bias, conv_state, parent, cu, activation="silu"))
    expected, windows = sequential_tree_conv1d(x, weight, bias, conv_state, parent, cu)
    assert rel_err(out, expected) <= FP32_TOL
    sizes, cu_l = sizes_of(cu), cu.tolist()
    acc = torch.tensor([t // 2 for t in sizes])
    new = kernels.commit_conv_state(conv_state, x, parent, cu, acc)
    assert torch.equal(new, commit_conv_state(conv_state, x, parent, cu, acc))
    for b, a in enumerate(acc.tolist()):
        assert torch.equal(new[b], windows[cu_l[b] + a].float())
