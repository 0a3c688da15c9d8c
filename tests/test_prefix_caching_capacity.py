"""A KV cache that one request of ``max_model_len`` just fits: the start-up check of a Bole engine counts the block
vLLM's block pool keeps as its null block (``_vllm_compat.wrap_kv_cache_check``).

With prefix caching vLLM keeps the GDN state in its "align" mode: a request holds two state blocks per GDN group (the
last cached boundary's and the running one) and one per 128 tokens in each attention group. On the tiny Qwen3.5 at
512 tokens that is 3 x 2 + 2 x 4 = 14 blocks under Bole's KV-cache groups, and the pool hands out all blocks but the
null block: 14 blocks passed vLLM's check and a 382-token prompt waited forever (its first chunk ran, its second
found 6 blocks free for 7 and preempted it, again and again). 15 blocks serve it.
"""

import random

import pytest

from e2e_support import assert_same_logprobs, bole_engine, run_engine, vocab_size, write_oracle
from vllm_bole.testing.shape_specs import engine_config, layer_specs

ENGINE = {"enable_prefix_caching": True, "max_model_len": 512}
TIGHT = 14   # blocks of one request of 512 tokens, without the null block


@pytest.fixture(scope="module", autouse=True)
def _registered():
    from vllm_bole import plugin

    plugin.register()


def _shape_config(spec, prefix_caching: bool, spec_blocks: int = 0):
    """The Qwen3.5-9B shape's config (2048 tokens) and its layer specs, the MTP layer's attention included."""
    cfg = engine_config(spec, prefix_caching)
    return cfg, layer_specs(cfg, spec_blocks, mtp=True)


@pytest.mark.parametrize("prefix_caching,state_blocks", [(True, 2), (False, 1)])
def test_request_price_counts_state_blocks_and_the_null_block(prefix_caching, state_blocks):
    """kv_groups prices a request of max_model_len (2048 tokens, 4 attention blocks of 528) in Bole's 11 groups of 3
    layers: per GDN group the state blocks vLLM's mode holds ("align": 2), per attention group 4, and the null block."""
    from vllm.v1.core.kv_cache_utils import _pool_bytes_per_block, get_kv_cache_groups
    from vllm.v1.kv_cache_interface import MambaSpec

    from vllm_bole._vllm_compat import kv_bytes_per_request

    cfg, specs = _shape_config({"method": "bole"}, prefix_caching)
    assert cfg.cache_config.mamba_cache_mode == ("align" if prefix_caching else "none")
    groups = get_kv_cache_groups(cfg, specs)
    gdn = sum(isinstance(g.kv_cache_spec, MambaSpec) for g in groups)
    assert (gdn, len(groups) - gdn, cfg.cache_config.block_size) == (8, 3, 528)
    blocks = kv_bytes_per_request(cfg, groups) / _pool_bytes_per_block(cfg, groups)
    assert blocks == 8 * state_blocks + 3 * 4 + 1


def test_vllm_chain_is_priced_as_vllm_prices_it():
    """vLLM's own MTP keeps vLLM's accounting (no null block): 3 GDN groups of 2 + 3 state blocks, one attention
    group of 4."""
    from vllm.v1.core.kv_cache_utils import _pool_bytes_per_block, get_kv_cache_groups

    from vllm_bole._vllm_compat import kv_bytes_per_request

    cfg, specs = _shape_config({"method": "mtp", "num_speculative_tokens": 3}, True, spec_blocks=3)
    groups = get_kv_cache_groups(cfg, specs)
    assert [len(g.layer_names) for g in groups] == [8, 8, 8, 9]
    assert kv_bytes_per_request(cfg, groups) / _pool_bytes_per_block(cfg, groups) == 3 * (2 + 3) + 4


@pytest.mark.parametrize("setting", ["num_gpu_blocks_override", "kv_cache_memory_bytes"])
def test_start_up_check_refuses_a_cache_one_block_short(setting):
    """29 blocks (28 for the request) start; 28 fail at start with one line naming max_model_len and the setting."""
    from vllm.v1.core.kv_cache_utils import _pool_bytes_per_block, get_kv_cache_configs, get_kv_cache_groups

    def configs(blocks: int):
        cfg, specs = _shape_config({"method": "bole"}, True)
        per_block = _pool_bytes_per_block(cfg, get_kv_cache_groups(cfg, dict(specs)))
        setattr(cfg.cache_config, setting, blocks if setting == "num_gpu_blocks_override" else blocks * per_block)
        return get_kv_cache_configs(cfg, [specs], [blocks * per_block]), per_block

    kv_config, per_block = configs(29)
    assert kv_config[0].num_blocks == 29
    with pytest.raises(ValueError) as error:
        configs(28)
    size, target = (("num_gpu_blocks_override=28", "29") if setting == "num_gpu_blocks_override" else
                    (f"kv_cache_memory_bytes={28 * per_block}", f"at least {29 * per_block}"))
    assert str(error.value) == (
        "To serve at least one request with the model's max seq len (2048), speculative method 'bole' needs 29 KV "
        f"cache blocks (28 for the request in 11 KV cache groups and the null block), more than the 28 of the KV "
        f"cache ({size}). Based on the available memory, the estimated maximum model length is 1584. Try "
        f"increasing `{setting}` to {target} or decreasing `max_model_len` when initializing the engine.")


def _prompts(model) -> list[dict]:
    """The prompt that waited forever (382 tokens) run to max_model_len, and a prompt of max_model_len - 1 tokens."""
    rng, vocab = random.Random(3), vocab_size(model)
    lens = ((382, 130), (511, 1))   # (prompt tokens, max_tokens)
    return [{"prompt": [rng.randrange(10, vocab) for _ in range(n)], "max_tokens": m} for n, m in lens]


@pytest.mark.vllm
def test_cache_one_block_short_refuses_to_start(tmp_path, tiny_qwen3_5_dir):
    """14 blocks: the engine that let the 382-token prompt wait forever now fails at start, in one line."""
    engine = {"speculative_config": {"method": "bole"}, "num_gpu_blocks_override": TIGHT, **ENGINE}
    with pytest.raises(AssertionError) as error:   # run_engine: the engine's process failed
        run_engine(tmp_path, "tight", {"model": tiny_qwen3_5_dir, "engine": engine,
                                       "requests": _prompts(tiny_qwen3_5_dir)[:1]}, timeout=300)
    lines = [line.split("ValueError: ", 1)[1] for line in str(error.value).splitlines() if "ValueError: " in line]
    assert lines and lines[-1] == (
        "To serve at least one request with the model's max seq len (512), speculative method 'bole' needs 15 KV "
        "cache blocks (14 for the request in 5 KV cache groups and the null block), more than the 14 of the KV cache "
        "(num_gpu_blocks_override=14). Based on the available memory, the estimated maximum model length is 384. "
        "Try increasing `num_gpu_blocks_override` to 15 or decreasing `max_model_len` when initializing the engine.")


@pytest.mark.vllm
def test_cache_of_one_request_serves_max_model_len(tmp_path, tiny_qwen3_5_dir):
    """15 blocks, a cache of one request of max_model_len: both prompts run to max_model_len, and their greedy
    outputs equal vLLM's without speculation."""
    model = tiny_qwen3_5_dir
    requests = _prompts(model)
    ref = run_engine(tmp_path, "ref", {"model": model, "requests": requests, "logprobs": 1, "engine": ENGINE})
    write_oracle(tmp_path, requests, ref)
    engine = bole_engine(tmp_path, "bole", depth=6, topk=2, budget=64, num_gpu_blocks_override=TIGHT + 1, **ENGINE)
    out = run_engine(tmp_path, "bole", {"model": model, "requests": requests, "logprobs": 1, "engine": engine},
                     timeout=300)
    assert [o["tokens"] for o in out["outputs"]] == [o["tokens"] for o in ref["outputs"]]
    assert [len(o["tokens"]) for o in out["outputs"]] == [130, 1]
    assert_same_logprobs(ref, out)
    assert out["counters"]["num_accepted_tokens"] > 0, out["counters"]
