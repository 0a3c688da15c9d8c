"""GDN metadata shared by the GDN KV-cache groups (``attention/gdn_metadata.py``): another group's metadata moved
onto this group's block table equals what vLLM's GDN builder builds from that block table, for batches of spec
decodes (trees), plain decodes and prefills in any mix."""

import dataclasses
import random

import pytest
import torch

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def builder(tiny_qwen3_5_dir):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import MambaSpec

    from vllm_bole import plugin
    from vllm_bole.attention.gdn_metadata import BoleGDNMetadataBuilder
    from vllm_bole.testing.tiny_models import engine_kwargs

    plugin.register()   # (vLLM loads plugins once per process, and this process may have done so before)
    kwargs = engine_kwargs() | {"max_num_seqs": 8}
    config = EngineArgs(model=tiny_qwen3_5_dir, speculative_config={"method": "bole", "num_speculative_tokens": 3,
                                                                    "topk": 2, "budget": 16},
                        **kwargs).create_engine_config()
    spec = MambaSpec(block_size=16, shapes=((4, 8), (2, 8, 8)), dtypes=(torch.bfloat16, torch.float32),
                     mamba_type="gdn_attention")
    return BoleGDNMetadataBuilder(spec, ["layer"], config, torch.device("cpu"))


def _batch(rng: random.Random, kinds: list[str]):
    """CommonAttentionMetadata and draft counts of requests of ``kinds`` ("tree", "decode", "prefill")."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    lens, drafts, computed = [], [], []
    for kind in kinds:
        if kind == "tree":
            n = rng.randint(0, 6)
            lens.append(n + 1)
            drafts.append(n)
        elif kind == "decode":
            lens.append(1)
            drafts.append(-1)
        else:
            lens.append(rng.randint(2, 9))
            drafts.append(-1)
        computed.append(rng.randint(0, 20) if kind == "prefill" else rng.randint(1, 20))
    b = len(kinds)
    qsl = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    seq = torch.tensor([c + n for c, n in zip(computed, lens)], dtype=torch.int32)
    meta = CommonAttentionMetadata(
        query_start_loc=qsl.clone(), query_start_loc_cpu=qsl, seq_lens=seq.clone(), _seq_lens_cpu=seq,
        _num_computed_tokens_cpu=torch.tensor(computed, dtype=torch.int32), num_reqs=b,
        num_actual_tokens=int(qsl[-1]), max_query_len=max(lens), max_seq_len=int(seq.max()),
        block_table_tensor=torch.randint(1, 100, (b, 1), dtype=torch.int32),
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.long), causal=True)
    return meta, torch.tensor(drafts, dtype=torch.int32)


def _fields(meta) -> dict:
    return {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)}


def _same(a, b) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("kinds", [["tree"], ["tree"] * 5, ["decode"] * 3, ["prefill"], ["decode", "prefill"],
                                   ["tree", "prefill", "tree"], ["decode", "tree", "prefill", "decode"],
                                   "random"])
def test_update_equals_a_fresh_build(builder, kinds):
    rng = random.Random(str(kinds))
    for trial in range(20 if kinds == "random" else 3):
        batch_kinds = ([rng.choice(["tree", "decode", "prefill"]) for _ in range(rng.randint(1, 8))]
                       if kinds == "random" else kinds)
        # vLLM orders a batch: decodes (and spec decodes) first, then prefills.
        batch_kinds = sorted(batch_kinds, key=lambda k: k == "prefill")
        cm, drafts = _batch(rng, batch_kinds)
        accepted = torch.ones(len(batch_kinds), dtype=torch.int32)
        first = builder.build(0, cm, num_accepted_tokens=accepted, num_decode_draft_tokens_cpu=drafts)
        other_table = torch.randint(100, 200, cm.block_table_tensor.shape, dtype=torch.int32)
        fresh = builder.build(0, dataclasses.replace(cm, block_table_tensor=other_table),
                              num_accepted_tokens=accepted, num_decode_draft_tokens_cpu=drafts)
        moved = builder.update_block_table(first, other_table, cm.slot_mapping)
        want, got = _fields(fresh), _fields(moved)
        assert want.keys() == got.keys()
        bad = [k for k in want if not _same(want[k], got[k])]
        assert not bad, (batch_kinds, bad)
        # The slots moved (the tables' ids do not overlap) and the first build's own are untouched.
        slots = [k for k in ("spec_state_indices_tensor", "non_spec_state_indices_tensor", "prefill_state_indices")
                 if isinstance(got[k], torch.Tensor) and got[k].numel()]
        assert slots and all(bool((got[k] >= 100).all()) for k in slots), (batch_kinds, slots)
        assert all(bool((getattr(first, k) < 100).all()) for k in slots)


def test_supported_only_without_full_graphs_and_with_one_state_slot(builder):
    assert builder.supports_update_block_table
    assert not builder.use_full_cuda_graph
    assert builder.vllm_config.cache_config.mamba_cache_mode == "none"
