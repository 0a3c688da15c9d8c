"""A drafter level's top children: each row's top-k probabilities under the softmax of its logits, and their token
ids, in one pair of Triton launches.

For logits ``[R, V]`` the result is ``[R, 2k]`` float32: ``exp(top_k - logsumexp)`` in descending order, then the
token ids of those k entries (through the draft vocabulary's ``ids`` when given; exact in float32 for
vocabularies < 2^24), so one copy to the host carries both. Among equal logits the lowest index comes first.
NaN logits count as -inf, so every returned id is a real token whatever a row holds: the padding rows of a
drafter graph attend to nothing and may hold NaN, and an index past the vocabulary would be read out of ``ids``.

The torch version (:func:`top_children_reference`, also the CPU path) is a float copy, topk, logsumexp, exp,
a gather and a cat: about a dozen small kernels per drafter level, captured in every drafter graph, each costing
more to launch than to run. Here a first launch splits every row into chunks (a handful of rows and a vocabulary
of up to ~250k would leave one-program-per-row launches serial) and reduces each chunk to its max, its sum of
exponentials and its own top k; a second launch merges a row's chunks. Nothing is read back on the host, so the
pair is capturable in a CUDA graph.
"""

import torch
import triton
import triton.language as tl

from .. import _use_triton

MAX_K = 16
BLOCK_V = 2048   # a chunk: ~120 programs per row at a 248k vocabulary, enough to fill the GPU with a few rows
_NONE = tl.constexpr(2**31 - 1)   # the index of "no candidate": a chunk with fewer than k live entries


def top_children_reference(logits: torch.Tensor, k: int, ids: torch.Tensor | None = None) -> torch.Tensor:
    """``logits`` ``[R, V]`` (any float dtype), ``ids`` ``[V]`` int64 (draft vocabulary -> target token ids) or
    None. Returns ``[R, 2k]`` float32: the top-k probabilities (descending), then their token ids."""
    logits = logits.float()
    top, tok = logits.topk(k, dim=-1)
    p = torch.exp(top - torch.logsumexp(logits, dim=-1, keepdim=True))
    if ids is not None:
        tok = ids[tok]
    return torch.cat([p, tok.float()], dim=1)


def top_children(logits: torch.Tensor, k: int, ids: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`top_children_reference`; on CUDA the fused kernels (:func:`top_children_triton`)."""
    if _use_triton(logits):
        return top_children_triton(logits, k, ids)
    return top_children_reference(logits, k, ids)


@triton.jit
def _take_best(val, idx):
    """The best of ``val`` (among equal values the lowest index) and its index, then ``val`` and ``idx`` without it.
    A taken or missing entry (index ``_NONE``) never comes back."""
    v = tl.max(val, axis=0)
    pick = tl.min(tl.where((val == v) & (idx != _NONE), idx, _NONE), axis=0)
    taken = idx == pick
    return v, pick, tl.where(taken, float("-inf"), val), tl.where(taken, _NONE, idx)


@triton.jit(do_not_specialize=["V", "row_stride", "n_chunks"])
def _chunk_top_kernel(logits, top_val, top_idx, chunk_max, chunk_sum, V, row_stride, n_chunks,
                      K: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    live = offs < V
    x = tl.load(logits + row * row_stride + offs, mask=live, other=float("-inf")).to(tl.float32)
    x = tl.where(x == x, x, float("-inf"))   # NaN: -inf (a padding row's garbage still picks real tokens)
    m = tl.max(x, axis=0)
    # A chunk of -inf only (masked logits) adds nothing to the sum rather than exp(nan).
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(tl.exp(x - m_safe), axis=0)
    stat = row * n_chunks + c
    tl.store(chunk_max + stat, m)
    tl.store(chunk_sum + stat, s)
    idx = tl.where(live, offs, _NONE)
    out = (row * n_chunks + c) * K
    for r in tl.static_range(K):
        v, pick, x, idx = _take_best(x, idx)
        tl.store(top_val + out + r, v)
        tl.store(top_idx + out + r, pick)


@triton.jit(do_not_specialize=["n_chunks", "ids_stride"])
def _merge_top_kernel(top_val, top_idx, chunk_max, chunk_sum, ids, out, n_chunks, ids_stride,
                      K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, HAS_IDS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cs = tl.arange(0, BLOCK_C)
    m = tl.load(chunk_max + row * n_chunks + cs, mask=cs < n_chunks, other=float("-inf"))
    s = tl.load(chunk_sum + row * n_chunks + cs, mask=cs < n_chunks, other=0.0)
    big = tl.max(m, axis=0)
    big_safe = tl.where(big == float("-inf"), 0.0, big)
    lse = big + tl.log(tl.sum(s * tl.exp(m - big_safe), axis=0))
    n = n_chunks * K
    j = tl.arange(0, BLOCK_N)
    val = tl.load(top_val + row * n + j, mask=j < n, other=float("-inf"))
    idx = tl.load(top_idx + row * n + j, mask=j < n, other=_NONE)
    # A chunk's empty slots hold -inf with no index: never a candidate.
    val = tl.where(idx == _NONE, float("-inf"), val)
    for r in tl.static_range(K):
        # Candidates' indices are distinct, so the lowest index among equal values is the lowest token.
        v, pick, val, idx = _take_best(val, idx)
        pick = tl.where(pick == _NONE, 0, pick)   # unreachable for k <= V; never an index past the vocabulary
        tl.store(out + row * (2 * K) + r, tl.exp(v - lse))
        if HAS_IDS:
            tok = tl.load(ids + pick.to(tl.int64) * ids_stride).to(tl.float32)
        else:
            tok = pick.to(tl.float32)
        tl.store(out + row * (2 * K) + K + r, tok)


def top_children_triton(logits: torch.Tensor, k: int, ids: torch.Tensor | None = None) -> torch.Tensor:
    """The fused path of :func:`top_children`: ``logits`` ``[R, V]`` with a contiguous last dim (rows may be
    strided), ``1 <= k <= min(16, V)``. Scratch: ``[R, cdiv(V, BLOCK_V), k]`` candidates and ``[R, chunks]``
    partial logsumexps."""
    rows, V = logits.shape
    if not 1 <= k <= min(MAX_K, V):
        raise ValueError(f"top_children: k={k} outside 1..{min(MAX_K, V)} (V={V})")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    out = torch.empty(rows, 2 * k, dtype=torch.float32, device=dev)
    if rows == 0:
        return out
    block = min(BLOCK_V, max(16, triton.next_power_of_2(V)))
    chunks = triton.cdiv(V, block)
    top_val = torch.empty(rows, chunks, k, dtype=torch.float32, device=dev)
    top_idx = torch.empty(rows, chunks, k, dtype=torch.int32, device=dev)
    stats = torch.empty(2, rows, chunks, dtype=torch.float32, device=dev)
    _chunk_top_kernel[(rows, chunks)](logits, top_val, top_idx, stats[0], stats[1], V, logits.stride(0), chunks,
                                      K=k, BLOCK=block, num_warps=4)
    _merge_top_kernel[(rows,)](top_val, top_idx, stats[0], stats[1], out if ids is None else ids, out, chunks,
                               0 if ids is None else ids.stride(0), K=k,
                               BLOCK_N=max(16, triton.next_power_of_2(chunks * k)),
                               BLOCK_C=max(16, triton.next_power_of_2(chunks)), HAS_IDS=ids is not None,
                               num_warps=4)
    return out
