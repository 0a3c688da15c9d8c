"""vLLM general plugin: makes ``speculative_config={"method": "bole"}`` work in ``LLM(...)`` and ``vllm serve``.

Loaded by vLLM in every process (``vllm.general_plugins`` entry point ``bole``); registration is idempotent and
changes nothing unless a Bole config is present.
"""

from .config import ADDITIONAL_CONFIG_KEY, BOLE_METHOD, BoleConfigError, parse_bole_config
from .logger import init_logger

logger = init_logger(__name__)
_REGISTERED = False

# Hybrid architectures whose GDN layers, attention layers and MTP head Bole knows.
SUPPORTED_ARCHITECTURES = (
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
    "Qwen3NextForCausalLM",
)


def _has_mtp_head(hf_config) -> bool:
    text = getattr(hf_config, "text_config", hf_config)
    return bool(getattr(text, "mtp_num_hidden_layers", 0) or getattr(text, "num_nextn_predict_layers", 0))


def apply_bole_engine_args(engine_args, target_model_config, target_parallel_config) -> None:
    """Translate a Bole speculative config in place (no-op for any other method)."""
    spec = engine_args.speculative_config
    if not isinstance(spec, dict) or spec.get("method") != BOLE_METHOD:
        return
    cfg, passthrough = parse_bole_config(spec)
    archs = getattr(target_model_config.hf_config, "architectures", None) or []
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise BoleConfigError(
            f"model: speculative method 'bole' needs a hybrid GDN model ({', '.join(SUPPORTED_ARCHITECTURES)}); "
            f"got architectures {archs}")
    if not _has_mtp_head(target_model_config.hf_config):
        raise BoleConfigError(
            "model: speculative method 'bole' needs the model's MTP head (mtp_num_hidden_layers > 0 in its config)")
    if engine_args.enable_prefix_caching:
        _check_prefix_caching(engine_args)
    if target_parallel_config.pipeline_parallel_size > 1:
        raise BoleConfigError(
            "pipeline_parallel_size: speculative method 'bole' supports 1 only, got "
            f"{target_parallel_config.pipeline_parallel_size}")
    if cfg.draft_vocab not in (None, "auto"):   # its ids against the vocabulary, here where a bad one fails in one line
        from .spec_decode.draft_vocab import draft_token_ids

        draft_token_ids(cfg.draft_vocab, target_model_config.get_vocab_size(), set())
    # Async scheduling (the scheduler fixes each request's tree size before the step that drafts it,
    # worker/scheduler.py) as vLLM decides it for MTP: on unless turned off, here also where Bole's settings need
    # synchronous steps; asked for explicitly, such settings are an error.
    unsupported = _async_unsupported(cfg, target_parallel_config, engine_args)
    if engine_args.async_scheduling is True and unsupported:
        raise BoleConfigError(unsupported)
    asynchronous = engine_args.async_scheduling is not False and unsupported is None
    if engine_args.async_scheduling is None and unsupported:
        logger.info("Bole schedules synchronously: %s", unsupported.split(";")[0])

    engine_args.speculative_config = {
        "method": "mtp", "num_speculative_tokens": cfg.max_nodes_per_request, **passthrough}
    engine_args.additional_config = {**(engine_args.additional_config or {}), ADDITIONAL_CONFIG_KEY: cfg.to_dict()}
    engine_args.async_scheduling = asynchronous
    # Tree batches are not uniform decodes: vLLM's full CUDA graphs would replay a chain-shaped capture without
    # Bole's per-step forest, so only piecewise graphs (GDN and attention run eagerly between pieces) are used.
    from vllm.config import CUDAGraphMode

    cc = engine_args.compilation_config
    if cc.cudagraph_mode is None or cc.cudagraph_mode.has_full_cudagraphs():
        if cc.cudagraph_mode is not None:
            logger.warning("Bole uses piecewise CUDA graphs; overriding cudagraph_mode=%s", cc.cudagraph_mode.name)
        cc.cudagraph_mode = CUDAGraphMode.PIECEWISE
    engine_args.scheduler_cls = ("vllm_bole.worker.scheduler.BoleAsyncScheduler" if asynchronous
                                 else "vllm_bole.worker.scheduler.BoleScheduler")
    target_parallel_config.worker_cls = "vllm_bole.worker.worker.BoleWorker"
    logger.info("Bole tree speculation: depth %d, topk %d, budget %s, drafter %s%s, %s scheduling",
                cfg.max_depth, cfg.topk, cfg.budget, cfg.drafter,
                "" if cfg.draft_vocab is None else f", draft_vocab {cfg.draft_vocab}",
                "async" if asynchronous else "synchronous")


def config_needs_synchronous(cfg) -> str | None:
    """Why a Bole config needs synchronous scheduling (tree sizes must be known when the scheduler places the next
    step's placeholders), as a one-line error for an explicit ``async_scheduling=True``; None if it does not."""
    if cfg.budget_rule not in ("decode", "throughput"):
        return (f"speculative_config.budget_rule must be 'decode' or 'throughput' with async_scheduling=True (the "
                f"budget is fixed before the step runs), got {cfg.budget_rule!r}")
    if cfg.selection != "per_request":
        return f"speculative_config.selection must be 'per_request' with async_scheduling=True, got {cfg.selection!r}"
    return None


def _check_prefix_caching(engine_args) -> None:
    """Bole caches the GDN state of hybrid models in vLLM's "align" mode only: the commit writes the state of every
    block boundary an accepted path crosses into the boundary's block (``attention/gdn.py`` ``commit_step``)."""
    mode = getattr(engine_args, "mamba_cache_mode", None)
    if mode not in (None, "none", "align"):   # ("none" is the unset default; vLLM then picks "align")
        raise BoleConfigError(
            f"mamba_cache_mode: speculative method 'bole' caches prefixes in mode 'align' only, got {mode!r}")


def _async_unsupported(cfg, parallel_config, engine_args) -> str | None:
    """Why these settings need synchronous scheduling: the config's reasons (:func:`config_needs_synchronous`),
    tensor parallelism, and where left unset, what turns vLLM's own default off; None if nothing does."""
    reason = config_needs_synchronous(cfg)
    if reason:
        return reason
    if parallel_config.tensor_parallel_size > 1:
        return ("async_scheduling: speculative method 'bole' supports it with tensor_parallel_size 1 only, got "
                f"{parallel_config.tensor_parallel_size}; set async_scheduling=False")
    if engine_args.async_scheduling is None:   # vLLM's own default would turn it off here
        backend = getattr(engine_args, "distributed_executor_backend", None)
        if backend not in (None, "uni", "mp"):
            return f"distributed_executor_backend {backend!r}"
        if _platform_is_cpu():
            return "vLLM schedules synchronously on CPU"
    return None


def _platform_is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def register() -> None:
    """Entry point for ``vllm.general_plugins``."""
    global _REGISTERED
    if _REGISTERED:
        return
    from . import _vllm_compat

    _vllm_compat.wrap_create_speculative_config(apply_bole_engine_args)
    _vllm_compat.wrap_align_hybrid_block_size(is_bole_engine)
    _vllm_compat.wrap_validate_params(is_bole_engine)
    from .worker.kv_groups import fewest_bytes_groups

    _vllm_compat.wrap_kv_cache_groups(is_bole_engine, fewest_bytes_groups)
    from .worker.warmup import warm_up

    _vllm_compat.run_when_engine_core_built(warm_up)
    _REGISTERED = True


def is_bole_engine(vllm_config) -> bool:
    """Whether ``vllm_config`` is a Bole engine's (its translated settings ride in ``additional_config``)."""
    return ADDITIONAL_CONFIG_KEY in (vllm_config.additional_config or {})
