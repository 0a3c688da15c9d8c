"""One device-beam level's bookkeeping after its MTP forward, in one Triton launch: one program per request.

Same contract as the torch twin ``reference.beam_advance``: each frontier query's ``k`` top children become
candidates (token, cumulative score, parent), the ``k`` best of them (score descending, ties to the earlier
candidate) the next frontier, and the next level's inputs are laid out: each new frontier node's ancestor region
(its parent query's, plus itself) and the MTP hidden state that predicted it.
In torch that is some thirty small kernels per level (casts, a sort, gathers, slice writes); inside a level's
CUDA graph each still costs a launch slot and a few microseconds of an otherwise idle GPU.
"""

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n", "m", "bit", "H", "stride_top", "stride_out", "stride_hid"])
def _beam_advance_kernel(top, rates, out, front, front_score, tokens, scores, parents, front_tok, front_slot,
                         front_ids, anc, bits, hid, n, m, bit, H, stride_top, stride_out, stride_hid,
                         K: tl.constexpr, KP: tl.constexpr, KKP: tl.constexpr, A: tl.constexpr,
                         AP: tl.constexpr, W: tl.constexpr, BH: tl.constexpr, SYNTHETIC: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, KKP)                 # candidate i: child i % K of frontier query i // K
    valid = i < K * K
    q = i // K
    row = g * K + q
    if SYNTHETIC:   # the rates the walk accepts each rank with, at this depth
        p = tl.load(rates + i % K, mask=valid, other=0.0)
    else:
        p = tl.load(top + row * stride_top + i % K, mask=valid, other=0.0).to(tl.float64)
    tok = tl.load(top + row * stride_top + K + i % K, mask=valid, other=0.0).to(tl.float64)
    score = tl.load(front_score + g * K + q, mask=valid, other=0.0) * p
    parent = tl.load(front + g * K + q, mask=valid, other=0)
    tl.store(tokens + g * m + n + i, tok, mask=valid)
    tl.store(scores + g * m + n + i, score, mask=valid)
    tl.store(parents + g * m + n + i, parent.to(tl.float64), mask=valid)
    # Candidate j beats i: a higher score, or the same score and an earlier index (a stable descending sort).
    beats = ((score[None, :] > score[:, None]) | ((score[None, :] == score[:, None]) & (i[None, :] < i[:, None])))
    rank = tl.sum((beats & valid[None, :]).to(tl.int32), axis=1)
    r = tl.arange(0, KP)
    rv = r < K
    pick = (rank[None, :] == r[:, None]) & valid[None, :]       # [KP, KKP]: rank r's candidate
    idx = tl.sum(tl.where(pick, i[None, :], 0), axis=1)
    new_tok = tl.sum(tl.where(pick, tok[None, :], 0.0), axis=1)
    new_score = tl.sum(tl.where(pick, score[None, :], 0.0), axis=1)
    slot = idx // K
    # The next level's rows: region of the parent query (read before any row is rewritten), plus the node itself.
    cols = tl.arange(0, AP)
    m2 = rv[:, None] & (cols < A)[None, :]
    region = tl.load(anc + (g * K + slot)[:, None] * A + cols[None, :], mask=m2, other=0)
    region = tl.where(cols[None, :] == bit + r[:, None], 1, region)
    tl.debug_barrier()
    tl.store(front + g * K + r, n + idx, mask=rv)
    tl.store(front_tok + g * K + r, new_tok, mask=rv)
    tl.store(front_score + g * K + r, new_score, mask=rv)
    tl.store(front_slot + g * K + r, slot, mask=rv)
    tl.store(front_ids + g * K + r, new_tok.to(tl.int64), mask=rv)
    tl.store(anc + (g * K + r)[:, None] * A + cols[None, :], region, mask=m2)
    # The same rows packed for the attention backend: column j at bit j % 32 of word j // 32.
    for w in tl.static_range(W):
        in_word = m2 & ((cols // 32) == w)[None, :] & (region != 0)
        word = tl.sum(tl.where(in_word, 1 << (cols % 32)[None, :], 0), axis=1)
        tl.store(bits + (g * K + r) * W + w, word, mask=rv)
    for h0 in range(0, H, BH):
        h = h0 + tl.arange(0, BH)
        mh = rv[:, None] & (h < H)[None, :]
        x = tl.load(out + (g * K + slot)[:, None] * stride_out + h[None, :], mask=mh, other=0.0)
        tl.store(hid + (g * K + r)[:, None] * stride_hid + h[None, :], x, mask=mh)


def beam_advance(state, d: int, out: torch.Tensor, top: torch.Tensor, rates: torch.Tensor | None) -> None:
    """Level ``d``'s update of ``state`` (a ``device_beam.BeamState`` of G requests), in place: ``out`` ``[G*k, H]``
    the level's MTP hidden states, ``top`` ``[G*k, 2k]`` float32 their top children (probabilities, token ids),
    ``rates`` ``[k]`` float64 the synthetic child scores at depth d + 1, or None (the probabilities)."""
    g, k = state.front.shape
    m, width = state.tokens.shape[1], state.anc.shape[2]
    hsize = out.shape[1]
    assert top.stride(1) == 1 and out.stride(1) == 1 and state.hid.stride(1) == 1
    assert all(t.is_contiguous() for t in (state.front, state.front_score, state.front_tok, state.front_slot,
                                           state.front_ids, state.anc, state.bits))
    assert all(t.stride() == (m, 1) for t in (state.tokens, state.scores, state.parents))
    if g == 0:
        return
    _beam_advance_kernel[(g,)](
        top, rates if rates is not None else top, out, state.front, state.front_score, state.tokens, state.scores,
        state.parents, state.front_tok, state.front_slot, state.front_ids, state.anc.view(torch.uint8), state.bits,
        state.hid, k + (d - 1) * k * k, m, d * k, hsize, top.stride(0), out.stride(0), state.hid.stride(0),
        K=k, KP=triton.next_power_of_2(k), KKP=triton.next_power_of_2(k * k), A=width,
        AP=triton.next_power_of_2(width), W=state.bits.shape[1], BH=min(1024, triton.next_power_of_2(hsize)),
        SYNTHETIC=rates is not None,
        num_warps=4)
