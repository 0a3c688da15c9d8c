"""KV-cache groups of a Bole engine (``worker/kv_groups.py``) on the Qwen3.5-9B shape, through the functions vLLM's
engine core sizes its KV cache with (``get_kv_cache_configs``, ``get_kv_cache_capacity``): the layer specs are
built from the config as the layers build them (8 attention layers, 24 GDN layers, the MTP layer's attention),
without weights.

The measured GPU runs at 18 GiB (docs/results.md): AR 159.6, Bole with vLLM's groups 141.7, MTP k=3 60.2."""

import pytest

from vllm_bole.testing.shape_specs import engine_config, layer_specs

GIB = 1 << 30


@pytest.fixture(scope="module", autouse=True)
def _registered():
    from vllm_bole import plugin

    plugin.register()


def _concurrency(spec, spec_blocks: int, mtp: bool, gib: float):
    """(max concurrency of 2048-token requests, KV-cache config) at ``gib`` of KV cache."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity, get_kv_cache_configs

    cfg = engine_config(spec)
    kv_config = get_kv_cache_configs(cfg, [layer_specs(cfg, spec_blocks, mtp)], [int(gib * GIB)])[0]
    return get_kv_cache_capacity(cfg, kv_config)[1], kv_config


def _ar(gib):
    return _concurrency(None, 0, False, gib)[0]


def _bole(gib):
    return _concurrency({"method": "bole"}, 0, True, gib)


@pytest.mark.parametrize("gib,ar,bole", [(16, 141.71, 132.35), (18, 159.57, 148.90)])
def test_bole_concurrency_is_ar_less_the_mtp_layer_kv(gib, ar, bole):
    """The MTP layer's K/V alone separates Bole from AR: 60 pages per request against AR's 56 (AR's count matches
    the measured 159.6 at 18 GiB), where vLLM's groups of 9 layers paid 63."""
    got_ar = _ar(gib)
    got_bole, kv_config = _bole(gib)
    assert got_ar == pytest.approx(ar, abs=0.01)
    assert got_bole == pytest.approx(bole, abs=0.01)
    assert got_bole / got_ar > 0.93
    groups = kv_config.kv_cache_groups
    slots = len(groups) * max(len(g.layer_names) for g in groups)
    assert slots == 33   # 8 + 1 attention layers, 24 GDN layers: no padding slot


def test_vllm_groups_keep_a_ninth_page_on_every_gdn_block():
    """``kv_cache_groups: "vllm"``: vLLM's own groups (9 layers each), Bole at 89% of AR, as measured."""
    got, kv_config = _concurrency({"method": "bole", "kv_cache_groups": "vllm"}, 0, True, 18)
    assert got == pytest.approx(141.71, abs=0.01)
    assert [len(g.layer_names) for g in kv_config.kv_cache_groups] == [8, 8, 8, 9]


def test_mtp_layer_shares_a_group_with_target_attention_layers():
    """The drafter's layer sits in an attention group of the same spec (its block table is that group's); every
    layer is in exactly one group, GDN groups hold GDN layers only."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    _, kv_config = _bole(18)
    names = [n for g in kv_config.kv_cache_groups for n in g.layer_names]
    assert len(names) == len(set(names)) == 33
    mtp = next(g for g in kv_config.kv_cache_groups if "mtp.layers.0.self_attn.attn" in g.layer_names)
    assert isinstance(mtp.kv_cache_spec, FullAttentionSpec) and len(mtp.layer_names) == 3
    kinds = [type(g.kv_cache_spec) for g in kv_config.kv_cache_groups]
    assert kinds.count(MambaSpec) == 8 and kinds.count(FullAttentionSpec) == 3


def test_vllm_chain_is_untouched():
    """vLLM's own MTP (k=3) keeps vLLM's groups: the split applies to Bole engines only."""
    got, kv_config = _concurrency({"method": "mtp", "num_speculative_tokens": 3}, 3, True, 18)
    assert got == pytest.approx(60.19, abs=0.01)
    assert [len(g.layer_names) for g in kv_config.kv_cache_groups] == [8, 8, 8, 9]


def test_split_interleaves_as_vllm_does():
    from vllm_bole.worker.kv_groups import split_layers

    assert split_layers([list("abcdefghi"), list("0123")], 3) == [
        list("adg"), list("beh"), list("cfi"), list("02"), list("13")]
