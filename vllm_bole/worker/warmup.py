"""Bole's start-up warm-up (``speculative_config.warmup``): requests run through the engine before it reports
ready, so that serving does not capture CUDA graphs or compile Triton kernels on first use.

Bole captures its full graphs (verification steps, the drafter's catch-up and tree levels) per shape the first
time a shape occurs, and Triton compiles a kernel the first time it meets new constant arguments; each stalls its
step, a capture by 50-150 ms at 9B shapes. Under online load the batch changes every few steps, so the first minutes
of serving would meet one new shape after another. vLLM captures its own graphs at start; Bole's depend on tree
sizes and the drafter's levels, which only real steps produce, so the warm-up runs real steps: for every batch size
in :func:`batch_sizes`, prompts of :func:`prompt_lengths` tokens (a short one and, where the model is long enough,
one past the tree-attention route's threshold), half arriving while the other half decodes (steps mixing prefill
chunks and trees), greedy and sampled requests side by side. It ends with the tree kernels' launch variants of
such mixed steps, which run eagerly (``worker/kernel_warmup.py``).

The warm-up goes through the engine core's own scheduler and executor, and its outputs go nowhere: no client
sees them and no metric counts them. Afterwards nothing of it stays behind but compiled kernels and captured
graphs: its requests are finished, the prefix cache is reset and the model runner forgets what it learned from
its random traffic (``BoleModelRunnerMixin.bole_after_warmup``: the budget policy's measurements, the draft
vocabulary's counts, recorded walks). vLLM's kernel JIT monitor, active since vLLM's own warm-up, does not report
the compilations of this one (``BoleWorker.bole_before_warmup``).
"""

import time

import numpy as np
from vllm import SamplingParams
from vllm.platforms import current_platform
from vllm.v1.engine import EngineCoreRequest

from ..attention.tree_attn_gpu import INLINE_PREFIX_MAX_SEQ
from ..config import bole_config_from_vllm
from ..logger import init_logger

logger = init_logger(__name__)

# Output tokens of each warm-up request: enough steps per batch size for the drafter's deeper levels and the
# budget rule's first choices.
OUTPUT_TOKENS = 32
# The short prompt (the tree kernel reads whole prefixes) and the long one, past the attention route's threshold
# (attention/tree_attn_gpu.py, 512 keys: FlashAttention's prefix pass, then the tree kernel).
SHORT_PROMPT, LONG_PROMPT = 32, INLINE_PREFIX_MAX_SEQ + 128
# Steps the first half of a batch decodes before the second half arrives.
STAGGER_STEPS = 2
REQUEST_PREFIX = "bole-warmup-"
# Engine steps in a row that run nothing before the warm-up gives up (a request the scheduler never takes).
IDLE_STEPS = 100


def wanted(vllm_config) -> bool:
    """Whether this engine warms up: ``warmup`` true, or "auto" where CUDA graphs run."""
    cfg = bole_config_from_vllm(vllm_config)
    if cfg is None or cfg.warmup is False:
        return False
    if cfg.warmup is True:
        return True
    return current_platform.is_cuda() and not vllm_config.model_config.enforce_eager


def batch_sizes(max_num_seqs: int) -> list[int]:
    """Powers of two below ``max_num_seqs``, then ``max_num_seqs``: the request buckets of Bole's graph keys."""
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return sizes + [max_num_seqs]


def prompt_lengths(max_len: int) -> list[int]:
    """The short prompt, and the long one where a request of it and its output fit ``max_len``."""
    return [n for n in (SHORT_PROMPT, LONG_PROMPT) if n + OUTPUT_TOKENS <= max_len] or [
        max(max_len - OUTPUT_TOKENS, 1)]


def special_token_ids(model_config) -> set[int]:
    """The config's special ids (``*_token_id``: image and video placeholders, vision start and end, EOS, ...),
    which a random prompt must not hold: a vision start without an image would make vLLM look for its grid."""
    ids = set()
    for config in {id(c): c for c in (model_config.hf_config, model_config.hf_text_config)}.values():
        for key, value in vars(config).items():
            if key.endswith("token_id") and isinstance(value, int):
                ids.add(value)
    return ids


def random_prompts(rng, count: int, length: int, vocab: int, avoid: set[int]) -> list[list[int]]:
    """``count`` prompts of ``length`` random token ids below ``vocab``, none of them in ``avoid``."""
    allowed = np.setdiff1d(np.arange(vocab), np.fromiter(avoid, dtype=np.int64, count=len(avoid)))
    return rng.choice(allowed, size=(count, length)).tolist()


def warm_up(engine_core) -> None:
    """Run the warm-up through ``engine_core`` (a Bole engine's, when :func:`wanted`) and leave it as it was."""
    vllm_config = engine_core.vllm_config
    if not wanted(vllm_config):
        return
    start = time.perf_counter()
    graphs_before = _graphs(engine_core)
    scheduler_config, model_config = vllm_config.scheduler_config, vllm_config.model_config
    max_len = model_config.max_model_len
    if not scheduler_config.enable_chunked_prefill:   # a prompt must then fit one step
        max_len = min(max_len, scheduler_config.max_num_batched_tokens)
    sizes, lengths = batch_sizes(scheduler_config.max_num_seqs), prompt_lengths(max_len)
    rng = np.random.default_rng(0)
    vocab, avoid = model_config.get_vocab_size(), special_token_ids(model_config)
    requests = steps = 0
    engine_core.model_executor.collective_rpc("bole_before_warmup")
    try:
        for length in lengths:
            for size in sizes:   # (requests counts the sizes done; aborting a failed one names all it added)
                prompts = random_prompts(rng, size, length, vocab, avoid)
                first = max(size // 2, 1)
                for begin, end, max_steps in ((0, first, STAGGER_STEPS), (first, size, None)):
                    for i in range(begin, end):
                        _add(engine_core, f"{REQUEST_PREFIX}{requests + i}", prompts[i], sampled=i % 2 == 1)
                    steps += _run(engine_core, max_steps)
                requests += size
    except _Stuck as e:   # serving goes on without the rest (a failing step fails the start, as in serving)
        logger.warning("Bole warm-up stopped early: %s; what it did not reach is captured and compiled on first "
                       "use", e)
        engine_core.abort_requests([f"{REQUEST_PREFIX}{i}" for i in range(requests + size)])
        _run(engine_core)
    engine_core.model_executor.collective_rpc("bole_warm_up_kernels")
    engine_core.reset_prefix_cache()
    engine_core.model_executor.collective_rpc("bole_after_warmup")
    graphs = _graphs(engine_core)
    logger.info("Bole warm-up: %d requests (batch sizes %s, prompts of %s tokens) in %d steps, %d verification and "
                "%d drafter CUDA graphs captured, in %.1f s", requests, ",".join(map(str, sizes)),
                " and ".join(map(str, lengths)), steps, graphs[0] - graphs_before[0], graphs[1] - graphs_before[1],
                time.perf_counter() - start)


def _add(engine_core, request_id: str, prompt: list[int], sampled: bool) -> None:
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True, temperature=1.0 if sampled else 0.0)
    request = EngineCoreRequest(request_id=request_id, prompt_token_ids=prompt, mm_features=None,
                                sampling_params=params, pooling_params=None, arrival_time=time.time(),
                                lora_request=None, cache_salt=None, data_parallel_rank=None)
    engine_core.add_request(*engine_core.preprocess_add_request(request))


class _Stuck(Exception):
    pass


def _run(engine_core, max_steps: int | None = None) -> int:
    """Engine steps as the engine core's busy loop runs them (outputs dropped) until no request is left, or
    ``max_steps`` of them; returns the steps run. Raises :class:`_Stuck` after :data:`IDLE_STEPS` steps in a row
    that ran nothing."""
    steps = idle = 0
    while engine_core.scheduler.has_requests() or engine_core.batch_queue:
        if max_steps is not None and steps >= max_steps:
            break
        _, executed = engine_core.step_fn()
        engine_core.post_step(executed)
        steps += 1
        idle = 0 if executed else idle + 1
        if idle >= IDLE_STEPS:
            raise _Stuck(f"{IDLE_STEPS} engine steps in a row scheduled nothing")
    return steps


def _graphs(engine_core) -> tuple[int, int]:
    """(verification, drafter) CUDA graphs the first worker's model runner holds."""
    return tuple(engine_core.model_executor.collective_rpc("bole_graph_counts")[0])
