"""Tree verification: walk each request's tree from the root, following the child whose token is the target's
token at the current node (the argmax for greedy requests, an exact sample for sampled ones), then add the bonus
token."""

import copy

import torch
from vllm.v1.sample.logits_processor.builtin import (LogitBiasLogitsProcessor, MinPLogitsProcessor,
                                                     MinTokensLogitsProcessor)
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.ops.topk_topp_sampler import (apply_top_k_top_p, empty_exponential_noise_like,
                                                 sample_with_exponential_noise)
from vllm.v1.sample.sampler import _SAMPLING_EPS, Sampler

from .tree import children_of


def _no_logits_processors(params) -> bool:
    """True when nothing but temperature, top-k, top-p, min-p and the seed shapes the next-token distribution."""
    return (
        params.presence_penalty == 0.0 and params.frequency_penalty == 0.0
        and params.repetition_penalty == 1.0
        and not params.prompt_logprobs
        and not params.bad_words and not params.logit_bias and not params.allowed_token_ids
        and not params.min_tokens
        and getattr(params, "structured_outputs", None) is None
        and getattr(params, "thinking_token_budget", None) is None
        and not getattr(params, "logprob_token_ids", None)
    )


def is_plain_greedy(params) -> bool:
    """True for requests whose next token is exactly the argmax of the raw logits (no logits processors).

    Requests that are neither plain greedy nor plain random (:func:`is_plain_random`) stay off the early path;
    their rows are processed on the host walk (:func:`processed_tree_rows`), or their trees verified only at the
    root (:func:`walks_tree`).
    """
    return params is not None and params.temperature == 0.0 and _no_logits_processors(params)


def is_plain_random(params) -> bool:
    """True for sampled requests (temperature > 0) whose only other settings are top-k, top-p, min-p and seed."""
    return params is not None and params.temperature >= _SAMPLING_EPS and _no_logits_processors(params)


def walks_tree(params, asynchronous: bool = False) -> bool:
    """True for requests whose tree is walked past its root: plain greedy and plain random ones, and those with
    penalties, bad words, allowed token ids, a logit bias or min_tokens, whose tree rows get vLLM's processing
    with each row's own output (:func:`processed_tree_rows`), and structured outputs (the scheduler's grammar
    bitmask has a row per tree node, ``worker/tree_grammar.py``). The others verify only the root, so drafts for
    them would be wasted, and they get none: prompt logprobs, thinking budgets, logprob token ids, and under async
    scheduling min_tokens (the runner's host copy of an output may still end in placeholders when its rows are
    processed: vLLM repairs those copies only for batches whose penalties or bad words read them, and a repair must
    run in every step, which the early path's steps skip; forcing it for every batch lost tokens from the copies
    and crashed an engine at max_model_len)."""
    if params is None:
        return False
    return not (params.prompt_logprobs or getattr(params, "thinking_token_budget", None) is not None
                or getattr(params, "logprob_token_ids", None) or (asynchronous and params.min_tokens))


def processed_tree_rows(logits: torch.Tensor, row_req: list[int], row_path: list[list[int]],
                        outputs: list[list[int]], params: list, md: SamplingMetadata) -> torch.Tensor:
    """``[R, V]`` float32 tree rows after vLLM's ``Sampler.apply_logits_processors``, each row processed as vLLM
    without speculation would process request ``row_req[i]`` (batch index) once its output (``outputs``, by batch
    index) had grown by ``row_path[i]``, the drafted tokens from the root's child down to the row's node. The same
    steps in the same order with vLLM's own functions: allowed token ids, bad words, min_tokens and logit bias
    (``md.logitsprocs``, in their order), penalties. ``logits`` is not modified."""
    from vllm.v1.sample.ops.bad_words import apply_bad_words
    from vllm.v1.sample.ops.penalties import apply_all_penalties

    rows = logits.to(torch.float32, copy=True)
    req = torch.tensor(row_req, dtype=torch.long).to(rows.device, non_blocking=True)
    row_outputs = [list(outputs[r]) + path for r, path in zip(row_req, row_path)]
    if md.allowed_token_ids_mask is not None:
        rows.masked_fill_(md.allowed_token_ids_mask[req], float("-inf"))
    if md.bad_words_token_ids:
        apply_bad_words(rows, {i: md.bad_words_token_ids[r] for i, r in enumerate(row_req)
                               if r in md.bad_words_token_ids}, row_outputs)
    for processor in md.logitsprocs.non_argmax_invariant:
        index = [], []
        if isinstance(processor, MinTokensLogitsProcessor):
            # (as its add_request: masked while the output is shorter than min_tokens)
            for i, r in enumerate(row_req):
                p = params[r]
                if p.min_tokens and len(row_outputs[i]) < p.min_tokens and p.all_stop_token_ids:
                    stop = sorted(p.all_stop_token_ids)
                    index[0].extend([i] * len(stop))
                    index[1].extend(stop)
            if index[0]:
                rows.index_put_(_device_index(index, rows.device), processor.neg_inf_tensor)
        elif isinstance(processor, LogitBiasLogitsProcessor):
            biases = []
            for i, r in enumerate(row_req):
                for token, bias in processor.biases.get(r, {}).items():
                    index[0].append(i)
                    index[1].append(token)
                    biases.append(bias)
            if biases:
                rows[_device_index(index, rows.device)] += torch.tensor(biases, dtype=torch.float32).to(rows.device)
        else:
            raise NotImplementedError(f"tree rows with logits processor {type(processor).__name__}")
    if not md.no_penalties:
        rows = apply_all_penalties(rows, md.prompt_token_ids[req], md.presence_penalties[req],
                                   md.frequency_penalties[req], md.repetition_penalties[req], row_outputs)
    return rows


def _device_index(index: tuple[list[int], list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(torch.tensor(i, dtype=torch.long).to(device, non_blocking=True) for i in index)


def tree_rows_supported(sampling_metadata: SamplingMetadata) -> bool:
    """True when the batch's logits processors are vLLM's built-in ones, so that for a plain random request only
    min-p (the one argmax-invariant processor) acts and :func:`tree_row_probs` reproduces vLLM's processing."""
    procs = sampling_metadata.logitsprocs
    return (all(isinstance(p, MinPLogitsProcessor) for p in procs.argmax_invariant)
            and all(isinstance(p, (LogitBiasLogitsProcessor, MinTokensLogitsProcessor))
                    for p in procs.non_argmax_invariant))


def builtin_logitsprocs(vllm_config, device, is_pin_memory: bool, is_pooling_model: bool, custom_logitsprocs=()):
    """vLLM's built-in logits processors (min-p, logit bias, min-tokens), what ``build_logitsprocs`` gives an
    engine without speculation. With a speculative config it builds only min-tokens, since its rejection sampler
    cannot apply the others to drafts; Bole walks a plainly sampled tree with min-p (:func:`tree_row_probs`) and
    verifies only the root of any other request (vLLM's sampler, all of them). Custom processors stay rejected, as
    vLLM rejects them with speculative decoding."""
    from vllm.v1.sample.logits_processor import (BUILTIN_LOGITS_PROCESSORS, STR_SPEC_DEC_REJECTS_LOGITSPROCS,
                                                 LogitsProcessors)

    if is_pooling_model:
        return LogitsProcessors()
    if custom_logitsprocs:
        raise ValueError(STR_SPEC_DEC_REJECTS_LOGITSPROCS)
    return LogitsProcessors(ctor(vllm_config, device, is_pin_memory) for ctor in BUILTIN_LOGITS_PROCESSORS)


def _for_rows(processor, row_req: torch.Tensor):
    """``processor`` with its per-request state indexed by ``row_req`` (the request of each tree row)."""
    if isinstance(processor, MinPLogitsProcessor) and processor.min_p_count:
        rows = copy.copy(processor)
        rows.min_p = processor.min_p[row_req]
        return rows
    return processor


def tree_row_probs(logits: torch.Tensor, row_req: torch.Tensor, sampling_metadata: SamplingMetadata) -> torch.Tensor:
    """``[R, V]`` float32 next-token distribution at each tree row, processed the way vLLM's ``Sampler`` processes
    a row of request ``row_req[i]`` (batch index): temperature, argmax-invariant processors (min-p), then
    top-k/top-p, all with vLLM's own functions. ``logits`` (``[R, V]`` raw rows) is not modified."""
    md = sampling_metadata
    rows = logits.to(torch.float32, copy=True)
    rows = Sampler.apply_temperature(rows, md.temperature[row_req], all_random=True)
    for processor in md.logitsprocs.argmax_invariant:
        rows = _for_rows(processor, row_req).apply(rows)
    top_k = None if md.top_k is None else md.top_k[row_req]
    top_p = None if md.top_p is None else md.top_p[row_req]
    rows = apply_top_k_top_p(rows, top_k, top_p)
    return rows.softmax(dim=-1, dtype=torch.float32)


def sample_tree_rows(logits: torch.Tensor, row_req: list[int], sampling_metadata: SamplingMetadata,
                     use_fp64_gumbel: bool = False, row_depth: list[int] | None = None,
                     seeded: "SeededDraws | None" = None) -> list[int]:
    """One draw per tree row from :func:`tree_row_probs` (:func:`draw_tree_rows`), on the host."""
    return draw_tree_rows(logits, row_req, sampling_metadata, use_fp64_gumbel, row_depth, seeded).tolist()


def draw_tree_rows(logits: torch.Tensor, row_req: list[int], sampling_metadata: SamplingMetadata,
                   use_fp64_gumbel: bool = False, row_depth: list[int] | None = None,
                   seeded: "SeededDraws | None" = None) -> torch.Tensor:
    """One draw per tree row from :func:`tree_row_probs`, on the logits' device (no copy to the host): the argmax
    of the row's probabilities over exponential noise, as vLLM's ``random_sample``.

    Rows of unseeded requests take independent noise from the default generator. Rows of a seeded request
    (``sampling_metadata.generators``, by batch index) take the noise of their depth (``row_depth``, the root 0):
    one noise vector per depth, drawn from the request's own generator in depth order, shared by the nodes of
    that depth. A walk visits one node per depth, so the emitted tokens stay exact samples, and the token at
    output position p reads the p-th noise vector of the request's stream, as it does without speculation, once
    ``seeded`` (:class:`SeededDraws`) has moved the generator back to just after the vectors the emitted tokens
    used: the output then depends on the seed alone, not on the trees (their size follows the batch)."""
    # (a non-blocking copy: a blocking one would wait for the work queued before it)
    req = torch.tensor(row_req, dtype=torch.long).to(logits.device, non_blocking=True)
    probs = tree_row_probs(logits, req, sampling_metadata)
    q = empty_exponential_noise_like(probs, use_fp64_gumbel)
    gens = sampling_metadata.generators
    rows_of: dict[int, list[int]] = {}
    for i, r in enumerate(row_req):
        if r in gens:
            rows_of.setdefault(r, []).append(i)
    if sum(len(rows) for rows in rows_of.values()) != len(row_req):
        q.exponential_()
    for r, rows in rows_of.items():
        if row_depth is None:
            raise ValueError("draw_tree_rows: rows of seeded requests need their depths (row_depth)")
        depths = [row_depth[i] for i in rows]
        noise = seeded_noise(gens[r], max(depths) + 1, q, r, seeded)
        index = torch.tensor(rows, dtype=torch.long).to(q.device, non_blocking=True)
        q[index] = noise[torch.tensor(depths, dtype=torch.long).to(q.device, non_blocking=True)]
    return sample_with_exponential_noise(probs, q)


def seeded_noise(generator: torch.Generator, depths: int, like: torch.Tensor, req: int,
                 seeded: "SeededDraws | None") -> torch.Tensor:
    """``[depths, V]`` exponential noise from ``generator``, one vector per depth in order (each as vLLM's
    sampler draws a row's), remembering the generator's state after each vector in ``seeded``."""
    noise = torch.empty((depths, like.shape[1]), dtype=like.dtype, device=like.device)
    states = [generator.get_state()]
    for d in range(depths):
        noise[d].exponential_(generator=generator)
        states.append(generator.get_state())
    if seeded is not None:
        seeded.states[req] = states
    return noise


class SeededDraws:
    """The generator states of the seeded requests whose tree rows a step drew (:func:`draw_tree_rows`): after
    the walk each generator goes back to just after the noise vectors its emitted tokens used (one per token),
    whatever else the step drew from it (deeper depths, vLLM's sampler at the bonus row)."""

    def __init__(self):
        self.states: dict[int, list[torch.Tensor]] = {}   # batch index -> state after 0, 1, ... vectors

    def rewind(self, generators: dict[int, torch.Generator], emitted: dict[int, int]) -> None:
        """``emitted``: tokens the step emitted per batch index (accepted drafts + the bonus)."""
        for r, states in self.states.items():
            generators[r].set_state(states[emitted[r]])


def row_depths(parents: list[int]) -> list[int]:
    """Depth of every node of a verification tree (``parents[0] = -1``, the root, depth 0)."""
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    return depth


def walk_tree(parents: list[int], tokens: list[int], targets: list[int]) -> list[int]:
    """Accepted path (local node indices, root first) of one verification tree.

    ``parents[0] = -1`` is the root; ``targets[i]`` is the target's token after node i. At node i the walk moves
    to the child whose token is ``targets[i]`` and stops where there is none; ``targets`` of the last node is then
    the bonus token.

    Greedy requests pass the argmax of each row. Sampled requests pass one independent draw per row from the
    processed target distribution ("sample, then match"): every emitted token is the draw of the row whose
    prefix is exactly the tokens emitted before it, so the emitted sequence has the distribution of plain
    autoregressive sampling, whatever the tree holds.
    """
    children = children_of(parents)
    path = [0]
    while True:
        want = targets[path[-1]]
        nxt = next((c for c in children.get(path[-1], ()) if tokens[c] == want), None)
        if nxt is None:
            return path
        path.append(nxt)


def pad_outputs(outputs: list[list[int]], device, min_width: int = 1) -> torch.Tensor:
    """The emitted tokens as vLLM's padded ``[num_reqs, width]`` matrix (-1 past each request's tokens)."""
    width = max([min_width] + [len(o) for o in outputs])
    out = torch.full((len(outputs), width), -1, dtype=torch.int32)
    for i, o in enumerate(outputs):
        out[i, :len(o)] = torch.tensor(o, dtype=torch.int32)
    return out.to(device)
