"""Bole's speculative-config translation and validation (no engine start needed)."""

import json

import pytest

from vllm_bole.config import BoleConfig, BoleConfigError, parse_bole_config


def test_defaults():
    cfg, rest = parse_bole_config({"method": "bole"})
    assert cfg == BoleConfig(max_depth=8, topk=4, budget="auto", drafter="mtp")
    assert cfg.max_nodes_per_request == 32 and rest == {}


def test_values_and_dashes():
    cfg, _ = parse_bole_config({"method": "bole", "num-speculative-tokens": 3, "topk": 2, "budget": 64})
    assert (cfg.max_depth, cfg.topk, cfg.budget) == (3, 2, 64)
    assert cfg.cuda_graphs and not parse_bole_config({"method": "bole", "cuda_graphs": False})[0].cuda_graphs
    assert cfg.early_drafting and not parse_bole_config({"method": "bole", "early-drafting": False})[0].early_drafting
    assert cfg.kv_cache_groups == "fewest_bytes"
    assert parse_bole_config({"method": "bole", "kv_cache_groups": "vllm"})[0].kv_cache_groups == "vllm"


def test_the_kv_groups_environment_variable_names_its_config_key(monkeypatch):
    monkeypatch.setenv("VLLM_BOLE_KV_GROUPS", "vllm")
    with pytest.raises(BoleConfigError, match=r"^VLLM_BOLE_KV_GROUPS is no longer read: set speculative_config"
                                              r"\.kv_cache_groups \('fewest_bytes' or 'vllm'\) instead$"):
        parse_bole_config({"method": "bole"})


@pytest.mark.parametrize("key,value,field", [
    ("num_speculative_tokens", 0, "num_speculative_tokens"),
    ("num_speculative_tokens", 33, "num_speculative_tokens"),
    ("num_speculative_tokens", "8", "num_speculative_tokens"),
    ("topk", 0, "topk"),
    ("topk", True, "topk"),
    ("budget", "big", "budget"),
    ("budget", -1, "budget"),
    ("drafter", "eagle", "drafter"),
    ("drafter_args", [1], "drafter_args"),
    ("budget_table", 3, "budget_table"),
    ("budget_table", "", "budget_table"),
    ("cuda_graphs", "yes", "cuda_graphs"),
    ("cuda_graphs", 1, "cuda_graphs"),
    ("early_drafting", "on", "early_drafting must be true or false"),
    ("early_drafting", 0, "early_drafting must be true or false"),
    ("warmup", "yes", "warmup must be 'auto', true or false"),
    ("warmup", 1, "warmup must be 'auto', true or false"),
    ("kv_cache_groups", "fewest", r"kv_cache_groups must be one of \['fewest_bytes', 'vllm'\]"),
    ("budget_rule", "fast", "budget_rule"),
    ("selection", "per-request", r"selection must be one of \['per_request', 'global'\]"),
    ("tree", [[0]], "unknown key"),
    ("draft_vocab", 3, r"draft_vocab must be an integer in \[4, "),   # fewer tokens than topk children
    ("draft_vocab", True, "draft_vocab"),
    ("draft_vocab", "/no/such/ids.json", "draft_vocab must be a token count, \"auto\" or the path"),
])
def test_bad_values_name_the_field(key, value, field):
    with pytest.raises(BoleConfigError, match=field) as e:
        parse_bole_config({"method": "bole", key: value})
    assert "\n" not in str(e.value)


def test_budget_rule():
    cfg, _ = parse_bole_config({"method": "bole", "budget-rule": "step"})
    assert (cfg.budget, cfg.budget_rule) == ("auto", "step")
    # "auto" reads the table by the throughput rule unless told otherwise; a fixed budget reads no table.
    assert parse_bole_config({"method": "bole"})[0].budget_rule == "throughput"
    assert parse_bole_config({"method": "bole", "budget_rule": "decode"})[0].budget_rule == "decode"
    assert parse_bole_config({"method": "bole", "budget": 64})[0].budget_rule == "decode"
    with pytest.raises(BoleConfigError, match="budget_rule applies only with budget 'auto'"):
        parse_bole_config({"method": "bole", "budget": 64, "budget_rule": "step"})


def test_selection():
    assert parse_bole_config({"method": "bole"})[0].selection == "per_request"
    cfg, _ = parse_bole_config({"method": "bole", "selection": "global", "budget": 64})
    assert (cfg.selection, cfg.budget) == ("global", 64)


def test_draft_vocab(tmp_path):
    assert parse_bole_config({"method": "bole"})[0].draft_vocab == "auto"   # the default of the MTP drafter
    assert parse_bole_config({"method": "bole", "draft_vocab": None})[0].draft_vocab is None   # the full vocabulary
    assert parse_bole_config({"method": "bole", "drafter": "pkg.mod:Drafter"})[0].draft_vocab is None
    assert parse_bole_config({"method": "bole", "draft-vocab": 32768})[0].draft_vocab == 32768
    ids = tmp_path / "ids.json"
    ids.write_text("[5, 7, 9]")
    assert parse_bole_config({"method": "bole", "draft_vocab": str(ids)})[0].draft_vocab == str(ids)
    with pytest.raises(BoleConfigError, match="draft_vocab applies only with drafter 'mtp'"):
        parse_bole_config({"method": "bole", "draft_vocab": 64, "drafter": "pkg.mod:Drafter"})


def test_budget_table_path():
    cfg, _ = parse_bole_config({"method": "bole", "budget-table": "/tmp/t.json"})
    assert (cfg.budget, cfg.budget_table) == ("auto", "/tmp/t.json")
    assert parse_bole_config({"method": "bole"})[0].budget_table is None


def test_budget_table_needs_auto_budget():
    with pytest.raises(BoleConfigError, match="budget_table applies only with budget 'auto'") as e:
        parse_bole_config({"method": "bole", "budget": 64, "budget_table": "/tmp/t.json"})
    assert "\n" not in str(e.value)


def test_round_trip_through_additional_config():
    cfg, _ = parse_bole_config({"method": "bole", "topk": 3, "drafter": "a.b:C", "drafter_args": {"x": 1},
                                "budget_table": "t.json"})
    assert BoleConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


class _Args:
    def __init__(self, spec, **kw):
        from vllm.config import CompilationConfig

        self.compilation_config = CompilationConfig()
        self.speculative_config = spec
        self.enable_prefix_caching = kw.get("prefix", False)
        self.async_scheduling = None
        self.additional_config = {}
        self.scheduler_cls = None


class _Parallel:
    pipeline_parallel_size = 1
    tensor_parallel_size = 1
    worker_cls = "auto"


class _Model:
    def __init__(self, archs, mtp=1):
        from types import SimpleNamespace

        self.hf_config = SimpleNamespace(architectures=archs, text_config=SimpleNamespace(mtp_num_hidden_layers=mtp))


def test_translation_sets_engine_fields():
    from vllm_bole.plugin import apply_bole_engine_args

    args, par = _Args({"method": "bole", "num_speculative_tokens": 3, "topk": 2}), _Parallel()
    args.async_scheduling = False
    apply_bole_engine_args(args, _Model(["Qwen3_5ForConditionalGeneration"]), par)
    assert args.speculative_config == {"method": "mtp", "num_speculative_tokens": 6}
    assert args.additional_config["bole"]["topk"] == 2
    assert args.async_scheduling is False
    assert args.scheduler_cls.endswith("BoleScheduler") and par.worker_cls.endswith("BoleWorker")
    assert args.compilation_config.cudagraph_mode.name == "PIECEWISE"


@pytest.mark.parametrize("flag,cpu,spec,tp,backend,expect", [
    (None, False, {}, 1, None, True),                         # vLLM's default for MTP: async
    (None, False, {"budget_rule": "throughput"}, 1, "mp", True),
    (False, False, {}, 1, None, False),                       # turned off
    (None, True, {}, 1, None, False),                         # vLLM's CPU platform schedules synchronously
    (None, False, {"budget_rule": "step"}, 1, None, False),   # settings that need synchronous steps
    (None, False, {"selection": "global"}, 1, None, False),
    (None, False, {}, 2, None, False),
    (None, False, {}, 1, "ray", False),                       # vLLM turns it off for that backend
])
def test_async_scheduling_follows_vllms_default(monkeypatch, flag, cpu, spec, tp, backend, expect):
    """Unset, async scheduling is on as vLLM has it for MTP, except where Bole's settings or vLLM's own rules
    need synchronous steps (then without an error); ``False`` turns it off."""
    from vllm_bole import plugin

    monkeypatch.setattr(plugin, "_platform_is_cpu", lambda: cpu)
    args = _Args({"method": "bole", **spec})
    args.async_scheduling, args.distributed_executor_backend = flag, backend
    parallel = _Parallel()
    parallel.tensor_parallel_size = tp
    plugin.apply_bole_engine_args(args, _Model(["Qwen3_5ForConditionalGeneration"]), parallel)
    assert args.async_scheduling is expect
    assert args.scheduler_cls.endswith(".BoleAsyncScheduler" if expect else ".BoleScheduler")


@pytest.mark.parametrize("spec", [{}, {"budget_rule": "throughput"}])
def test_async_scheduling_picks_the_async_scheduler(spec):
    from vllm_bole.plugin import apply_bole_engine_args

    args = _Args({"method": "bole", **spec})
    args.async_scheduling = True
    apply_bole_engine_args(args, _Model(["Qwen3_5ForConditionalGeneration"]), _Parallel())
    assert args.async_scheduling is True and args.scheduler_cls.endswith(".BoleAsyncScheduler")
    assert args.speculative_config["method"] == "mtp"   # vLLM allows async scheduling for it


@pytest.mark.parametrize("spec,tp,match", [
    ({"budget_rule": "step"}, 1,
     "speculative_config.budget_rule must be 'decode' or 'throughput' with async_scheduling=True .* got 'step'"),
    ({"selection": "global"}, 1, "speculative_config.selection must be 'per_request' with async_scheduling"),
    ({}, 2, "async_scheduling: .* tensor_parallel_size 1 only, got 2"),
])
def test_async_scheduling_rejects_what_it_cannot_run(spec, tp, match):
    from vllm_bole.plugin import apply_bole_engine_args

    args = _Args({"method": "bole", **spec})
    args.async_scheduling = True
    parallel = _Parallel()
    parallel.tensor_parallel_size = tp
    with pytest.raises(BoleConfigError, match=match) as e:
        apply_bole_engine_args(args, _Model(["Qwen3_5ForConditionalGeneration"]), parallel)
    assert "\n" not in str(e.value)
    assert args.speculative_config["method"] == "bole"   # nothing translated


def test_other_methods_untouched():
    from vllm_bole.plugin import apply_bole_engine_args

    spec = {"method": "mtp", "num_speculative_tokens": 2}
    args = _Args(dict(spec))
    apply_bole_engine_args(args, _Model(["Qwen3_5ForConditionalGeneration"]), _Parallel())
    assert args.speculative_config == spec and args.scheduler_cls is None


@pytest.mark.parametrize("model,kw,field", [
    (_Model(["LlamaForCausalLM"]), {}, "model"),
    (_Model(["Qwen3_5ForConditionalGeneration"], mtp=0), {}, "MTP head"),
])
def test_unsupported_setups(model, kw, field):
    from vllm_bole.plugin import apply_bole_engine_args

    with pytest.raises(BoleConfigError, match=field):
        apply_bole_engine_args(_Args({"method": "bole"}, **kw), model, _Parallel())


@pytest.mark.parametrize("asked", [None, True])
def test_prefix_caching_keeps_async_scheduling_graphs_and_early_drafting(monkeypatch, asked):
    from vllm_bole import plugin
    from vllm_bole.config import ADDITIONAL_CONFIG_KEY

    monkeypatch.setattr(plugin, "_platform_is_cpu", lambda: False)   # (a GPU's default)
    args = _Args({"method": "bole"}, prefix=True)
    args.async_scheduling = asked
    plugin.apply_bole_engine_args(args, _Model(["Qwen3NextForCausalLM"]), _Parallel())
    cfg = args.additional_config[ADDITIONAL_CONFIG_KEY]
    assert args.async_scheduling is True and cfg["early_drafting"] is True and cfg["cuda_graphs"] is True
    assert args.scheduler_cls.endswith("BoleAsyncScheduler")


def test_prefix_caching_refuses_what_it_cannot_run():
    from vllm_bole.plugin import apply_bole_engine_args

    args = _Args({"method": "bole"}, prefix=True)
    args.mamba_cache_mode = "all"
    with pytest.raises(BoleConfigError, match="mamba_cache_mode"):
        apply_bole_engine_args(args, _Model(["Qwen3_5ForConditionalGeneration"]), _Parallel())


def test_register_is_idempotent():
    from vllm.engine.arg_utils import EngineArgs

    from vllm_bole import plugin

    plugin.register()
    wrapped = EngineArgs.create_speculative_config
    plugin.register()
    assert EngineArgs.create_speculative_config is wrapped


def test_llm_rejects_bad_value_with_one_line(tiny_model_path):
    from vllm import LLM

    with pytest.raises(Exception, match="speculative_config.topk must be an integer"):
        LLM(model=tiny_model_path, speculative_config={"method": "bole", "topk": 99}, language_model_only=True,
            dtype="bfloat16", enforce_eager=True, max_model_len=256)


def test_engine_args_reject_a_draft_vocab_past_the_vocabulary(tiny_model_path):
    """Before any worker starts: the front end knows the vocabulary size."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_bole import plugin

    plugin.register()
    vocab = json.load(open(f"{tiny_model_path}/config.json"))["text_config"]["vocab_size"]
    args = EngineArgs(model=tiny_model_path, language_model_only=True, enable_prefix_caching=False,
                      speculative_config={"method": "bole", "draft_vocab": vocab + 1})
    with pytest.raises(BoleConfigError, match=f"draft_vocab must be at most the vocabulary size {vocab}") as e:
        args.create_engine_config()
    assert "\n" not in str(e.value)
    ok = EngineArgs(model=tiny_model_path, language_model_only=True, enable_prefix_caching=False,
                    speculative_config={"method": "bole", "draft_vocab": vocab // 2}).create_engine_config()
    assert ok.additional_config["bole"]["draft_vocab"] == vocab // 2


@pytest.fixture(scope="module")
def tiny_model_path():
    from vllm_bole.testing.tiny_models import tiny_model_dir

    return tiny_model_dir("qwen3_5")


def _aligned_cache(spec):
    """(attention block size, padded GDN page bytes, num_speculative_tokens after) of the 9B-shaped model's
    engine config once vLLM aligns its hybrid page sizes (CPU attention's alignment)."""
    from pathlib import Path

    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from vllm_bole import plugin

    plugin.register()
    model = Path(__file__).parent.parent / "benchmarks" / "models" / "qwen3.5-9b-shape"
    cfg = EngineArgs(model=str(model), skip_tokenizer_init=True, load_format="dummy", max_model_len=2048,
                     language_model_only=True, speculative_config=spec,
                     enable_prefix_caching=False).create_engine_config()
    Platform._align_hybrid_block_size(cfg, CPUAttentionBackend)
    spec_tokens = cfg.speculative_config.num_speculative_tokens if cfg.speculative_config else None
    return cfg.cache_config.block_size, cfg.cache_config.mamba_page_size_padded, spec_tokens


def test_bole_pages_are_sized_like_no_speculation():
    """Bole's GDN layers hold one state per request with a 3-column conv window; the KV page and the attention
    block size must follow that (as without speculation), not a conv window widened by every tree node."""
    plain_block, plain_page, _ = _aligned_cache(None)
    bole_block, bole_page, spec_tokens = _aligned_cache({"method": "bole"})
    assert (bole_block, bole_page) == (plain_block, plain_page)
    assert spec_tokens == 32     # the speculative config is back after the alignment
    chain_block, chain_page, _ = _aligned_cache({"method": "mtp", "num_speculative_tokens": 32})
    assert chain_page > plain_page   # what the unwrapped alignment sizes for 32 speculative tokens
