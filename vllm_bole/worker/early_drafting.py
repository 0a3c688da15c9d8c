"""Drafting queued behind the target forward, before the host walks the trees (``speculative_config.
early_drafting``, on by default).

In a step whose requests are all trees, greedy or sampled without other settings, nothing the drafter needs
waits for the host: right behind the forward the device walks the trees (``spec_decode/device_walk.py``),
copies the paths and tokens to the host once, runs the MTP drafter's first pass over every verified node
(``MTPTreeDrafter.first_pass_all_rows``), moves the paths' MTP K/V, grows the next trees from the path ends
(``MTPTreeDrafter.propose_from_walk``) and commits from the device paths. The runner's walk then only reads the
copy (``TreeWalk._walked_output``), which waits for the forward and the walk alone, and vLLM's drafting call finds the
drafts pending. Under vLLM's async scheduling there is no host copy: the step's tokens stay on the device
(``TreeWalk._device_output``), and the trees' sizes are the scheduler's (``Drafting.plan``).

A step whose trees run beside prefill chunks (a mixed step: a prompt's chunk, or a turn of a conversation, arriving
while others decode) takes the same path: the walk covers the trees, a chunk that completes its prompt emits its
sampled token (the argmax, or one draw) and drafts its first tree from its last row, and the first pass runs over
the chunks' rows too, causally. The step's rows sit in three orders there (tokens, logits, tree nodes:
``worker/step_rows.py``). Mixed steps without the device beam draft after the walk.
"""

from dataclasses import dataclass

import torch
from vllm.v1.utils import record_function_or_nullcontext

from .._vllm_compat import input_fits_in_drafter
from ..attention.gdn import commit_step
from ..logger import init_logger
from ..spec_decode.device_walk import greedy_walk, synthetic_targets
from ..spec_decode.drafter import DraftStep
from ..spec_decode.tree_sampler import draw_tree_rows, is_plain_greedy, is_plain_random, tree_rows_supported
from ..step.host_copy import HostCopy
from .kv_compaction import compact_accepted_kv
from .scheduler import Placeholders
from .step_rows import StepRows

logger = init_logger(__name__)


@dataclass
class EarlyDraft:
    """A step whose drafting started behind its target forward (:func:`launch`)."""

    # the rows' argmax, or the walk's paths and tokens, on their way to the host; None: the tokens stay on the device
    host: HostCopy | None
    rows: tuple | None                  # the drafter's (hidden, top children) per token row; None: catch up
    walk: object = None                 # the device walk of every batch request (DeviceWalk; rows: token rows)
    tree_walk: object = None            # the forest's walk (rows: node rows); ``walk`` in a step of trees only
    drafted: bool = False               # levels and commit queued too (:func:`_draft_before_walk`)
    next_tokens: tuple | None = None    # async scheduling: (next roots, emitted counts), counts sent to the host
    logit_starts: list | None = None    # per batch request, its first logits row (StepRows.logit_starts)

    def wait(self) -> torch.Tensor:
        return self.host.wait()


def launch(runner, scheduler_output) -> EarlyDraft | None:
    """Queue the drafter's first pass over every row of the step right behind the target forward, while the host
    is idle until the walk (``MTPTreeDrafter.first_pass_all_rows``), for steps whose requests are all trees, or
    trees and prefill chunks (mixed steps), greedy or sampled without other settings: a tree row's input is the
    target's token after it (the argmax, or for a sampled request the row's draw, which the walk then matches), a
    chunk row's the prompt's next token or, at a chunk's end, its sampled token. With the device beam the walk and
    the whole drafting follow on the device before the host walks (:func:`_draft_before_walk`); without it,
    greedy steps of trees only send the argmax to the host first, so the host walk waits for the forward alone.
    None when the step does not qualify (the drafter then catches up after the walk)."""
    drafter, forest, state = runner.bole_drafter, runner._bole_forest, runner.execute_model_state
    if (forest is None or not runner._bole_early_drafting or not drafter.drafts_early
            or state.logits is None or state.spec_decode_common_attn_metadata is None):
        return None
    metadata = runner.input_batch.sampling_metadata
    params = [runner.requests[r].sampling_params for r in runner.input_batch.req_ids]
    sampled = [b for b, p in enumerate(params) if not is_plain_greedy(p)]
    if not tree_rows_supported(metadata) or not all(is_plain_random(params[b]) for b in sampled):
        return None
    if any(b in metadata.generators for b in sampled):
        # A seeded request's generator goes back to the vectors its emitted tokens used, which the host learns
        # from the walk (tree_sampler.SeededDraws): its steps walk on the host.
        return None
    cm = state.spec_decode_common_attn_metadata
    early = (runner._bole_draft_before_walk and drafter.beam is not None and runner._bole_profiler is None
             and runner.bole_config.selection == "per_request" and input_fits_in_drafter(runner, cm)
             and (metadata.max_num_logprobs is None or runner.model_config.logprobs_mode == "raw_logprobs"))
    # Without the whole early path the host walk draws again (the first pass would read other tokens), and in a
    # mixed step it reads the argmax in its own layout.
    mixed = not forest.tree_only
    if ((sampled or mixed) and not early) or (mixed and not runner._bole_early_mixed):
        return None
    rows = StepRows.of(runner, forest, scheduler_output)
    if rows is None or state.logits.shape[0] != rows.logit_starts[-1]:
        return None
    try:
        return _first_pass(runner, scheduler_output, rows, sampled, early)
    except Exception as e:   # drafts only: the walk and drafting after it serve mixed steps from now on
        if not mixed:
            raise
        logger.warning("Bole's early drafting of steps with prefill chunks is off: it failed (%s: %s); those "
                       "steps draft after the walk", type(e).__name__, e)
        runner._bole_early_mixed = False
        forest.accepted_device, forest.accepted_rows_device = None, None
        runner.bole_drafting.pending = None
        return None


def _first_pass(runner, scheduler_output, rows: StepRows, sampled: list[int], early: bool) -> EarlyDraft:
    """:func:`launch` once the step qualifies: the targets after each row, the device walk (``early``), the host
    copy or the emitted counts, the drafter's first pass, and with ``early`` the drafting before the walk."""
    drafter, forest, state = runner.bole_drafter, runner._bole_forest, runner.execute_model_state
    metadata = runner.input_batch.sampling_metadata
    cm = state.spec_decode_common_attn_metadata
    num_reqs = runner.input_batch.num_reqs
    with record_function_or_nullcontext("bole: first_pass"):
        argmax = state.logits.argmax(dim=-1)
        nodes = argmax.numel() - len(rows.chunks)   # logits rows: one per tree node and per chunk
        n = scheduler_output.total_num_scheduled_tokens
        # The target's token after each logits row: the argmax, or for sampled requests one draw per row ("sample,
        # then match", as the host walk draws them; tree_sampler.draw_tree_rows).
        after = argmax
        if sampled:
            starts = rows.logit_starts
            drawn = [j for b in sampled for j in range(starts[b], starts[b + 1])]
            row_req = [b for b in sampled for _ in range(starts[b], starts[b + 1])]
            index = torch.tensor(drawn, dtype=torch.long).to(argmax.device, non_blocking=True)
            after = argmax.clone()
            after[index] = draw_tree_rows(state.logits[index], row_req, metadata,
                                          runner.sampler.use_fp64_gumbel).to(argmax.dtype)
        walk = tree_walk = None
        if early:   # the walk's paths and emitted tokens go to the host instead of the argmax
            tokens, parent = rows.node_input_tokens(runner.input_ids.gpu, nodes), forest.parent[:nodes]
            max_nodes = forest.max_nodes or None   # the one-launch walk's tile bound
            node_after = rows.by_node(after)
            targets = node_after
            if runner._bole_synthetic is not None:   # benchmarks: the targets drawn from the given rates
                targets = synthetic_targets(tokens, parent, forest.cu_seqlens, forest.depth_bound,
                                            runner._bole_synthetic, _synthetic_generator(runner, argmax.device),
                                            max_nodes=max_nodes)
            tree_walk = greedy_walk(targets, tokens, parent, forest.cu_seqlens, forest.depth_bound, node_after,
                                    max_nodes=max_nodes)
            trees, walk = rows.batch_walk(tree_walk, after, num_reqs)
        # Async scheduling: vLLM copies the emitted tokens itself, when it needs them.
        on_device = walk is not None and runner.bole_async and metadata.max_num_logprobs is None
        host = None
        if not on_device:   # the walk's paths and emitted tokens, or the argmax, to the host
            host = HostCopy(argmax if walk is None else
                            torch.cat([walk.rows, walk.emitted.long(), walk.length[:, None]], dim=1))
        # The emitted counts, which the next step's host preparation waits for, go to the host right behind the
        # walk rather than behind this step's drafting (as vLLM's MTP sends them before its drafter runs).
        next_tokens = runner.send_emitted_counts(walk.emitted) if on_device else None
        slots = runner.input_batch.block_table[drafter.proposer.kv_cache_gid].slot_mapping.gpu[:n]
        # Prefix + scheduled tokens per request. Under async scheduling the step was prepared from counts that
        # assumed every draft accepted; vLLM has corrected them on the host by now (after launching the forward),
        # so the drafter attends over the true prefixes.
        computed = runner.input_batch.num_computed_tokens_cpu[:num_reqs].tolist()
        seq_lens = [c + size for c, size in zip(computed, rows.sizes)]
        first_rows = drafter.first_pass_all_rows(cm, forest, rows.next_tokens(after, runner.input_ids.gpu, n),
                                                 runner.positions[:n], slots, rows.sizes, seq_lens,
                                                 state.hidden_states[:n], runner.bole_rope(n), rows.grown_from)
    runner.bole_first_pass_steps += 1
    first = EarlyDraft(host=host, rows=first_rows, walk=walk, tree_walk=tree_walk, next_tokens=next_tokens,
                       logit_starts=rows.logit_starts)
    if walk is not None:
        try:
            _draft_before_walk(runner, forest, trees, walk, first_rows, cm, max(seq_lens), rows, scheduler_output)
            first.drafted = True
            runner.bole_early_mixed_steps += not rows.tree_only
        except Exception as e:   # drafts only: this step drafts after the walk, with its catch-up
            if not rows.tree_only:   # (launch leaves this and later mixed steps to the drafting after the walk)
                raise
            logger.warning("Bole's drafting before the walk is off: it failed (%s: %s); drafting after it",
                           type(e).__name__, e)
            runner._bole_draft_before_walk = False
            forest.accepted_device, forest.accepted_rows_device = None, None
            runner.bole_drafting.pending, first.rows = None, None
    return first


def _synthetic_generator(runner, device) -> torch.Generator:
    gen = getattr(runner, "_bole_synthetic_gen", None)
    if gen is None or gen.device != torch.device(device):
        gen = runner._bole_synthetic_gen = torch.Generator(device=device)
        gen.manual_seed(runner._bole_synthetic.seed)
    return gen


def _draft_before_walk(runner, forest, trees, walk, first_pass, cm, root_bound: int, rows: StepRows,
                       scheduler_output) -> None:
    """The rest of the step on the device, queued before the host reads the walk: the paths' K/V to contiguous
    slots (every attention layer, the drafter's included), the next trees' levels from the path ends and the
    completed prompts' last rows (their drafts stay queued for the next step, as ``propose_draft_token_ids`` would
    leave them), then the commit (GDN state, conv windows) from the device paths. vLLM's drafting call then finds
    it done. ``trees``: the forest's walk with token rows; ``walk``: every batch request's (``StepRows.batch_walk``).
    Under async scheduling each tree's size is the scheduler's (``worker.scheduler.Placeholders``)."""
    drafter = runner.bole_drafter
    runner.bole_early_draft_steps += 1
    forest.accepted_device, forest.accepted_rows_device = trees.deepest, trees.rows
    # Profiling scopes (traces: benchmarks/step_profile.py --trace) for the host work queued here besides the
    # levels, which have their own.
    with record_function_or_nullcontext("bole: early_plan"):
        # Every attention layer's accepted K/V in one move: the levels read the drafter's own layers at contiguous
        # slots, and the target's layers are read by the next verification only.
        compact_accepted_kv(runner, forest, walk=trees, starts=rows.tree_starts)
        forest.kv_compacted = True
        # (a chunk that stops short of its prompt's end drafts nothing)
        step = DraftStep(req_ids=list(runner.input_batch.req_ids), contexts=[() if d else None for d in rows.drafts],
                         common_attn_metadata=cm)
        runner.bole_drafting.plan(step, Placeholders.of(scheduler_output), queued=True)
    finish = drafter.propose_from_walk(step, walk, first_pass, runner.positions, root_bound)
    runner.bole_drafting.pending = (step, finish)
    with record_function_or_nullcontext("bole: early_commit"):
        commit_step(forest)
