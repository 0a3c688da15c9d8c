"""The fused top children (kernels/tree_select/top_children.py, under Triton's interpreter without a GPU) against
the torch code it replaces."""

import pytest
import torch

from vllm_bole.kernels.tree_select.top_children import top_children_reference


def _kernel():
    from triton_modes import import_kernel_modules

    (mod,) = import_kernel_modules("vllm_bole.kernels.tree_select.top_children")
    return mod


def _distinct_logits(gen, rows, vocab, dtype):
    """Logits whose top 128 per row are distinct, also in bf16 (a grid of 1/8 from 4 down to -11.875, exact
    there), at random places; the rest lower and random (ties there are below every top k)."""
    n_top = min(vocab, 128)
    values = torch.cat([4 - torch.arange(n_top) * 0.125, -12 - 8 * torch.rand(vocab - n_top, generator=gen)])
    return torch.stack([values[torch.randperm(vocab, generator=gen)] for _ in range(rows)]).to(dtype)


def _check(mod, logits, k, ids=None):
    from triton_modes import DEV, interpreter

    with interpreter():
        got = mod.top_children_triton(logits.to(DEV), k, None if ids is None else ids.to(DEV)).cpu()
    want = top_children_reference(logits, k, ids)
    assert got.shape == want.shape == (logits.shape[0], 2 * k) and got.dtype == torch.float32
    torch.testing.assert_close(got[:, :k], want[:, :k], rtol=1e-5, atol=1e-7)
    assert torch.equal(got[:, k:], want[:, k:])


CASES = [  # rows, vocab, k, dtype
    (1, 1000, 1, torch.float32),        # one chunk, not full
    (1, 2048, 4, torch.bfloat16),       # exactly one chunk
    (3, 5000, 8, torch.float32),        # three chunks, the last one partial
    (64, 700, 4, torch.bfloat16),
    (5, 4500, 16, torch.bfloat16),      # the largest k
    (2, 40_000, 8, torch.bfloat16),     # many chunks
    (4, 17, 3, torch.float32),          # a tiny vocabulary
]


@pytest.mark.parametrize("with_ids", [False, True])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_fused_top_children_are_the_torch_ones(case, with_ids):
    rows, vocab, k, dtype = CASES[case]
    gen = torch.Generator().manual_seed(100 * case + with_ids)
    logits = _distinct_logits(gen, rows, vocab, dtype)
    ids = torch.randperm(3 * vocab, generator=gen)[:vocab] if with_ids else None
    _check(_kernel(), logits, k, ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_rows(dtype):
    """Rows of a wider buffer (a column slice): the row stride is not the vocabulary."""
    gen = torch.Generator().manual_seed(7)
    wide = _distinct_logits(gen, 6, 5300, dtype)
    logits = wide[:, 100:4200]
    assert logits.stride(0) == 5300 and not logits.is_contiguous()
    _check(_kernel(), logits, 5, torch.randperm(9000, generator=gen)[:4100])


def test_random_gaussian_logits():
    """Plain random logits over a vocabulary that is not a power of two."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(7, 3001, generator=gen) * 3
    top = logits.topk(9, dim=-1).values
    assert (top[:, :-1] > top[:, 1:]).all()     # no ties among the top ones, so the ids are the reference's
    _check(_kernel(), logits, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ties_take_the_lowest_indices(dtype):
    """Repeated maximal values, within a chunk and across chunks: the fused path returns the lowest indices among
    equal values, with the reference's probabilities."""
    from triton_modes import DEV, interpreter

    mod = _kernel()
    gen = torch.Generator().manual_seed(3)
    rows, vocab, k = 4, 5000, 6
    logits = torch.randint(-20, 0, (rows, vocab), generator=gen).float()
    logits[0, [4999, 3, 2100, 77, 4100]] = 5.0          # five equal maxima in three chunks, then one of -1s
    logits[1] = 1.0                                       # all equal: the first k
    logits[2, [10, 20, 2050, 4090]] = 2.0                 # equal pairs in two chunks, then across a boundary
    logits[2, [30, 2047, 2048]] = 1.5
    logits[3, 4096:] = 3.0                                # ties only in the last, partial chunk
    logits = logits.to(dtype)
    with interpreter():
        got = mod.top_children_triton(logits.to(DEV), k).cpu()
    want = top_children_reference(logits, k)
    x = logits.float()
    for r in range(rows):
        # Descending value, then ascending index.
        order = sorted(range(vocab), key=lambda i: (-x[r, i].item(), i))[:k]
        assert got[r, k:].long().tolist() == order, r
        torch.testing.assert_close(got[r, :k].sort().values, want[r, :k].sort().values, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(got[r, :k], want[r, :k], rtol=1e-5, atol=1e-7)   # sorted by value both


def test_masked_chunks():
    """-inf logits (a masked vocabulary) including whole chunks of them: the probabilities of the rest."""
    gen = torch.Generator().manual_seed(5)
    logits = _distinct_logits(gen, 3, 6000, torch.float32)
    logits[:, :4096] = float("-inf")
    logits[1, 5000:] = float("-inf")
    _check(_kernel(), logits, 4)


def test_no_rows():
    from triton_modes import DEV, interpreter

    mod = _kernel()
    with interpreter():
        got = mod.top_children_triton(torch.empty(0, 3000, dtype=torch.bfloat16, device=DEV), 4)
    assert got.shape == (0, 8) and got.dtype == torch.float32
    assert top_children_reference(torch.empty(0, 3000), 4).shape == (0, 8)


def test_cpu_dispatch_is_the_reference():
    """A CPU tensor takes the torch path."""
    from vllm_bole.kernels.tree_select import top_children as mod

    logits = torch.randn(2, 100)
    assert torch.equal(mod.top_children(logits, 3), top_children_reference(logits, 3))


@pytest.mark.parametrize("with_ids", [False, True])
def test_rows_of_nan_and_minus_inf_pick_real_tokens(with_ids):
    """A drafter graph's padding rows attend to nothing and may hold NaN or -inf: their ids must still be real
    tokens (an index past the vocabulary read through ``ids`` faulted on the GPU), and real rows beside them are
    unaffected. NaN counts as -inf: such a row picks its lowest ids."""
    from triton_modes import DEV, interpreter

    mod = _kernel()
    gen = torch.Generator().manual_seed(11)
    vocab, k = 5000, 4
    logits = _distinct_logits(gen, 5, vocab, torch.float32)
    logits[1] = float("nan")
    logits[2] = float("-inf")
    logits[3, ::2] = float("nan")   # half NaN: the finite half decides
    ids = torch.randperm(3 * vocab, generator=gen)[:vocab] if with_ids else None
    with interpreter():
        got = mod.top_children_triton(logits.to(DEV), k, None if ids is None else ids.to(DEV)).cpu()
    tokens = got[:, k:].long()
    vocab_ids = ids if ids is not None else torch.arange(vocab)
    assert bool(torch.isin(tokens, vocab_ids).all()), tokens
    lowest = vocab_ids[:k].float()
    assert torch.equal(got[1, k:], lowest) and torch.equal(got[2, k:], lowest), got[1:3]
    finite = logits[3].clone()
    finite[::2] = float("-inf")
    want = top_children_reference(torch.stack([logits[0], finite, logits[4]]), k, ids)
    assert torch.equal(got[[0, 3, 4], k:], want[:, k:])
    torch.testing.assert_close(got[[0, 4], :k], want[[0, 2], :k], rtol=1e-5, atol=1e-7)
