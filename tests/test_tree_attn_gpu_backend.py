"""Bole's FlashAttention backend on tree steps, against the torch reference.

Covers a step of tree rows only (vLLM's causal pass skipped, the prefix pass merged in place), tree rows
beside a prefill and a plain decode (causal pass first), the MTP drafter's levels (new rows at the end of a
longer region), both prefix routes (FlashAttention's prefix pass + tree kernel, tree kernel alone) and the
one-line error for unsupported layers. On a GPU the real FlashAttention runs (bf16, Qwen3.5-9B heads);
without one a torch stand-in with FlashAttention's varlen conventions and Triton's interpreter.
"""

import random
import types

import pytest
import torch

from triton_modes import DEV, GPU, import_kernel_modules

# Before vLLM imports Triton: without a GPU, Triton's own library must be built for the interpreter too.
import_kernel_modules("vllm_bole.kernels.tree_attention.triton_tree_attn")

from vllm.v1.attention.backends import fa_utils  # noqa: E402
from vllm.v1.attention.backends import flash_attn as vllm_flash_attn  # noqa: E402
from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadata  # noqa: E402

from paged_cache import shuffled_block_table  # noqa: E402
from sequential_gdn import rel_err, seed_of  # noqa: E402
from vllm_bole.attention import tree_attn_gpu  # noqa: E402
from vllm_bole.kernels.forest import ancestor_mask  # noqa: E402
from vllm_bole.kernels.tree_attention.reference import FlashPagedKV, paged_tree_attention  # noqa: E402
from vllm_bole.step.forest import StepForest, TreeRows, forest_scope  # noqa: E402

HQ, HKV, D, DTYPE, TOL = (16, 4, 256, torch.bfloat16, 2e-2) if GPU else (4, 2, 16, torch.float32, 1e-4)


def fake_flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k=None,
                                softmax_scale=None, causal=False, block_table=None, return_softmax_lse=False,
                                out=None, **_):
    """FlashAttention's paged varlen forward in torch (k, v: ``[num_blocks, block_size, Hkv, d]``); rows with
    no keys are NaN, which no caller may read."""
    n, hq, _ = q.shape
    out.fill_(float("nan"))
    lse = torch.full((hq, n), float("nan"), device=q.device)
    cu, used, bs = cu_seqlens_q.tolist(), seqused_k.tolist(), k.shape[1]
    for b in range(len(cu) - 1):
        m, keys = cu[b + 1] - cu[b], used[b]
        if m == 0 or keys == 0:
            continue
        pos = torch.arange(keys, device=q.device)
        blk = block_table[b, pos // bs].long()
        group = hq // k.shape[2]
        kk = k[blk, pos % bs].float().repeat_interleave(group, 1).transpose(0, 1)     # [Hq, keys, d]
        vv = v[blk, pos % bs].float().repeat_interleave(group, 1).transpose(0, 1)
        s = q[cu[b]:cu[b + 1]].float().transpose(0, 1) @ kk.transpose(1, 2) * softmax_scale
        if causal:   # aligned to the bottom right, as FlashAttention's
            s = s.masked_fill(pos[None, :] > keys - m + torch.arange(m, device=q.device)[:, None], float("-inf"))
        lse[:, cu[b]:cu[b + 1]] = torch.logsumexp(s, -1)
        out[cu[b]:cu[b + 1]] = (torch.softmax(s, -1) @ vv).transpose(0, 1).to(out.dtype)
    return (out, lse) if return_softmax_lse else out


@pytest.fixture(autouse=True)
def _flash_attention(monkeypatch):
    if not GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(fa_utils, "flash_attn_varlen_func", fake_flash_attn_varlen_func, raising=False)
        monkeypatch.setattr(vllm_flash_attn, "flash_attn_varlen_func", fake_flash_attn_varlen_func, raising=False)


def make_impl(**overrides):
    kw = dict(num_heads=HQ, head_size=D, scale=D ** -0.5, num_kv_heads=HKV, alibi_slopes=None,
              sliding_window=None, kv_cache_dtype="auto") | overrides
    impl = tree_attn_gpu.BoleFlashAttentionImpl(**kw)
    if impl.vllm_flash_attn_version is None:   # no GPU: the stand-in takes any version
        impl.vllm_flash_attn_version = 3
    return impl


class Step:
    """A batch of requests ``(kind, prefix, T, n)``: kind "tree" (a random tree of T nodes whose last n are this
    forward's rows), "prefill" (n causal rows after the prefix) or "decode" (one causal row). The cache (NHD
    physical layout, shuffled blocks) already holds every position's K/V, as vLLM writes it before forward."""

    def __init__(self, requests, *, block_size=16, seed=0):
        rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
        q_lens, seq_lens, self.tree_rows, self.causal_rows = [], [], [], []
        row = 0
        for b, (kind, prefix, t, n) in enumerate(requests):
            if kind == "tree":
                parent = torch.tensor([-1] + [rng.randrange(i) for i in range(1, t)], dtype=torch.int32)
                self.tree_rows.append(TreeRows(req_index=b, row_start=row, region_mask=ancestor_mask(parent)[t - n:]))
            else:
                n = t = 1 if kind == "decode" else n
                self.causal_rows.append(TreeRows(req_index=b, row_start=row,
                                                 region_mask=torch.ones(n, n, dtype=torch.bool).tril()))
            q_lens.append(n)
            seq_lens.append(prefix + t)
            row += n
        table, pool = shuffled_block_table(seq_lens, block_size, gen)
        kv = torch.randn(pool, block_size, HKV, 2 * D, generator=gen).to(DTYPE)
        self.kv_cache = kv.to(DEV).permute(0, 2, 1, 3)            # logical [blocks, Hkv, block_size, 2d]
        self.query = torch.randn(row + 3, HQ, D, generator=gen).to(DTYPE).to(DEV)   # 3 padding rows
        qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
        self.meta = FlashAttentionMetadata(
            num_actual_tokens=row, max_query_len=max(q_lens), query_start_loc=qsl.to(DEV), max_seq_len=max(seq_lens),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV), block_table=table.to(DEV),
            slot_mapping=torch.zeros(row, dtype=torch.long, device=DEV), use_cascade=False, common_prefix_len=0,
            cu_prefix_query_lens=None, prefix_kv_lens=None, suffix_kv_lens=None)
        self.seq_lens = seq_lens

    def expected(self):
        out = torch.zeros_like(self.query)
        paged_tree_attention(FlashPagedKV(self.kv_cache), self.query, out, self.seq_lens, self.meta.block_table,
                             self.tree_rows + self.causal_rows, D ** -0.5)
        return out

    def forward(self, impl, *, with_forest=True):
        layer = types.SimpleNamespace(**{f"_{x}_scale": torch.ones(1, device=DEV) for x in "qkv"})
        output = torch.full_like(self.query, 7.0)
        forest = StepForest(req_ids=[], tree_req_indices=[], parent=None, cu_seqlens=None, tokens=[],
                            attention_rows=self.tree_rows if with_forest else [])
        with forest_scope(forest):
            impl.forward(layer, self.query, None, None, self.kv_cache, self.meta, output)
        return output


ROUTES = ("prefix_pass", "tree_kernel_alone")


def check(step: Step, monkeypatch, route: str, **forward_kw):
    monkeypatch.setattr(tree_attn_gpu, "reads_prefix_itself", lambda *_: route == "tree_kernel_alone")
    got = step.forward(make_impl(), **forward_kw)
    want = step.expected()
    n = step.meta.num_actual_tokens
    assert torch.isfinite(got[:n].float()).all()
    assert (got[n:] == 7.0).all(), "padding rows must stay untouched"
    assert rel_err(got[:n], want[:n]) <= TOL


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("block_size", [16, 64])
def test_only_tree_rows(monkeypatch, route, block_size):
    step = Step([("tree", 37, 9, 9), ("tree", 0, 5, 5), ("tree", 300 if GPU else 90, 16, 16), ("tree", 2, 1, 1)],
                block_size=block_size, seed=seed_of("only", route, block_size))
    check(step, monkeypatch, route)


@pytest.mark.parametrize("route", ROUTES)
def test_tree_rows_beside_a_prefill_and_a_decode(monkeypatch, route):
    step = Step([("tree", 40, 7, 7), ("prefill", 10, 0, 24), ("tree", 0, 12, 12), ("decode", 33, 0, 0),
                 ("tree", 70, 3, 3)], seed=seed_of("mixed", route))
    check(step, monkeypatch, route)


@pytest.mark.parametrize("route", ROUTES)
def test_drafter_levels(monkeypatch, route):
    step = Step([("tree", 50, 12, 4), ("tree", 3, 20, 16), ("tree", 0, 1, 1), ("tree", 130, 9, 2)],
                seed=seed_of("drafter", route))
    check(step, monkeypatch, route)


def test_without_tree_rows_runs_vllms_causal_attention(monkeypatch):
    step = Step([("prefill", 10, 0, 24), ("decode", 33, 0, 0)], seed=seed_of("plain"))
    check(step, monkeypatch, "prefix_pass", with_forest=False)


def test_route_rule_reads_host_values(monkeypatch):
    monkeypatch.setattr(tree_attn_gpu, "_FORCED_MAX_SEQ", None)
    monkeypatch.setattr(tree_attn_gpu, "INLINE_PREFIX_MAX_SEQ", 512)
    assert tree_attn_gpu.reads_prefix_itself(132, 32 * 4)         # short prefixes, small trees: one launch
    assert tree_attn_gpu.reads_prefix_itself(192, 32 * 64)
    assert not tree_attn_gpu.reads_prefix_itself(192, 64 * 64)    # more wide trees than measured: the prefix pass
    assert not tree_attn_gpu.reads_prefix_itself(1028, 4)         # long prefixes
    monkeypatch.setattr(tree_attn_gpu, "_FORCED_MAX_SEQ", "0")   # the environment's one threshold
    monkeypatch.setattr(tree_attn_gpu, "INLINE_PREFIX_MAX_SEQ", 0)
    assert not tree_attn_gpu.reads_prefix_itself(5, 1)


def test_unsupported_layer_fails_in_one_line():
    step = Step([("tree", 5, 4, 4)], seed=seed_of("unsupported"))
    with pytest.raises(NotImplementedError, match="^Bole tree attention does not support sliding-window attention$"):
        step.forward(make_impl(sliding_window=64))
