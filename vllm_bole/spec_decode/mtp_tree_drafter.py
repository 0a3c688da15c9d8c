"""Tree drafter on the model's own MTP head.

After a verification step the MTP layer first catches up on the tokens the step committed (its KV at their
final positions; for a verified tree only the accepted path). Then it grows a tree level by level: the
``topk`` best new nodes of the last level (by cumulative draft probability) are fed back through the MTP
layer, each attending to the committed prefix plus its own ancestors' MTP entries (ancestor mask), and each
expands into its ``topk`` most probable children. Every created node is a candidate; the runner keeps the
best ones within the per-request and per-step budgets. The levels grow on the device
(``spec_decode/device_beam.py``) or, with ``VLLM_BOLE_HOST_DRAFT_LEVELS=1``, with host bookkeeping
(:meth:`MTPTreeDrafter._grow_on_host`, which also skips nodes the selection cannot keep).
"""

import functools
from dataclasses import dataclass, field

import numpy as np
import torch
from vllm.forward_context import set_forward_context
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.utils import record_function_or_nullcontext

from .. import envs
from .._vllm_compat import (drafter_padding, drafter_positions, drafter_slot_buffer, drafter_slot_mapping,
                             set_drafter_positions)
from ..kernels.tree_select.top_children import top_children
from ..logger import init_logger
from ..step.forest import DeviceTreeRows, StepForest, TreeRows, ancestor_masks, forest_scope
from .device_beam import DeviceBeam, request_rows
from .drafter import DraftStep, TreeDrafter, drafting
from .synthetic import parse_synthetic
from .tree import DraftTree, select_step, selection_floors

logger = init_logger(__name__)


def _to_device(values, device, dtype=torch.long) -> torch.Tensor:
    if isinstance(values, torch.Tensor):   # already computed on the device
        return values.to(device=device, dtype=dtype)
    # non-blocking: the GPU queue keeps running meanwhile
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _children_lists(top: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """Host lists (probabilities, token ids) per row of a ``[rows, 2k]`` top-children tensor."""
    rows = top.tolist()
    return [r[:k] for r in rows], [[int(t) for t in r[k:]] for r in rows]


@functools.cache
def _causal(n: int) -> torch.Tensor:
    """``[n, n]`` causal region mask: row j sees region keys 0..j."""
    return torch.ones(n, n, dtype=torch.bool).tril()


@dataclass
class _Growing:
    """One request's tree while it grows; ``query_of`` holds the MTP query index of each expanded node."""

    req_index: int
    next_pos: int                       # position of the root (the last sampled token)
    tree: DraftTree = field(default_factory=DraftTree)
    depth: list = field(default_factory=list)     # depth of every node (1 = child of the root)
    # node -> row, in the last MTP forward's output, of the hidden that predicted the node's children
    hidden_row: dict = field(default_factory=dict)
    query_of: dict = field(default_factory=dict)  # expanded node -> its index among this request's queries
    frontier: list = field(default_factory=list)  # nodes created in the last level

    def add_children(self, parent: int, scores: list[float], tokens: list[int]) -> None:
        """Children of ``parent`` (-1: the root) in probability order, ``scores`` relative to the parent."""
        base = 1.0 if parent < 0 else self.tree.scores[parent]
        depth = 1 if parent < 0 else self.depth[parent] + 1
        for p, t in zip(scores, tokens):
            self.tree.tokens.append(t)
            self.tree.parents.append(parent)
            self.tree.scores.append(base * p)
            self.depth.append(depth)
            self.frontier.append(len(self.tree) - 1)


class MTPTreeDrafter(TreeDrafter):
    selects = True   # propose returns the step's selection (tree.select_step) of the candidates
    drafts_early = True
    reads_contexts = False

    def __init__(self, runner, bole_config):
        super().__init__(runner, bole_config)
        self.proposer = runner.drafter  # vLLM's MTP proposer: owns the loaded MTP model and its KV group
        # Benchmarks with synthetic acceptance score children by the rates the walk accepts them with, as a
        # calibrated drafter would (dummy weights give meaningless draft probabilities).
        self.synthetic = parse_synthetic(bole_config.synthetic_acceptance)
        self._synthetic_scores: dict[int, list[float]] = {}
        # draft_vocab: the LM head's rows of the tokens the drafter may propose (None: the full vocabulary).
        self.draft_vocab = None
        if bole_config.draft_vocab is not None:
            from .draft_vocab import DraftVocab

            self.draft_vocab = DraftVocab.of_model(self.proposer.model, bole_config.draft_vocab, runner.model_config,
                                                   runner.parallel_config.tensor_parallel_size)
            self.observes_emitted = self.draft_vocab is not None and self.draft_vocab.adaptive is not None
        self.graphs = None   # full CUDA graphs of the tree levels (GPU): spec_decode/draft_graphs.py
        if runner.device.type == "cuda" and getattr(runner, "_bole_graphs_allowed", False):
            from .draft_graphs import DraftGraphs

            self.graphs = DraftGraphs(self)
        # Tree levels grown on the device (spec_decode/device_beam.py); VLLM_BOLE_HOST_DRAFT_LEVELS=1 grows them
        # with host bookkeeping instead (a copy of every level's top children to the host).
        self.beam = None
        if not envs.VLLM_BOLE_HOST_DRAFT_LEVELS:
            self.beam = self._device_beam()
        # Steps whose selection keeps chains (DraftStep.width 1) grow one query per request and level: a beam of
        # its own, made on first use.
        self.chain = None

    def _device_beam(self, width: int | None = None) -> DeviceBeam:
        beam = DeviceBeam(self, width)
        if self.graphs is not None:   # whole levels from full CUDA graphs too (GPU)
            from .beam_graphs import BeamGraphs

            beam.graphs = BeamGraphs(beam)
        return beam

    def beams(self) -> list[DeviceBeam]:
        """The device beams made so far (none with host-grown levels)."""
        return [b for b in (self.beam, self.chain) if b is not None]

    def _beam_for(self, step: DraftStep) -> DeviceBeam | None:
        """The device beam of ``step``'s width (None: levels grown on the host)."""
        if self.beam is None or step.width is None or step.width == self.beam.k:
            return self.beam
        if self.chain is None:
            self.chain = self._device_beam(step.width)
        self.chain_steps += 1
        return self.chain

    def _child_scores(self, probs: list[float], depth: int) -> list[float]:
        """Scores of a node's children (probability order) at ``depth``, relative to their parent."""
        if self.synthetic is None:
            return probs
        if depth not in self._synthetic_scores:
            self._synthetic_scores[depth] = [self.synthetic.child_probability(depth, rank)
                                             for rank in range(self.bole_config.topk)]
        return self._synthetic_scores[depth][:len(probs)]

    # ---- one MTP forward over a packed batch of per-request query chunks ----
    def _write_inputs(self, chunks, hidden: torch.Tensor, rope: torch.Tensor | None = None, sampled=None):
        """Token ids, positions, hidden states and KV slots of ``chunks`` into the proposer's persistent
        buffers, padded to a size vLLM captured. Returns (tokens, padded tokens, vLLM's graph mode).
        ``sampled``: (rows, device token ids) written over those rows' tokens (``DraftStep.sampled``)."""
        written = self._write_arrays([t for c in chunks for t in c[1]], [p for c in chunks for p in c[2]],
                                     [s for c in chunks for s in c[4]], hidden, rope)
        if sampled is not None:
            rows, tokens = sampled
            ids = self.proposer.input_ids
            ids.index_copy_(0, _to_device(rows, ids.device), tokens.to(ids.device, ids.dtype, non_blocking=True))
        return written

    def _write_arrays(self, tokens, positions, slots, hidden: torch.Tensor, rope: torch.Tensor | None = None):
        """:meth:`_write_inputs` of flat rows: ``tokens``, ``positions`` and ``slots`` host sequences or device
        tensors, ``hidden`` ``[rows, H]``. ``rope``: the rows' ``[3, rows]`` M-RoPE positions where they differ
        from the token positions (:meth:`text_offsets`); otherwise every section takes the token position."""
        device, proposer = hidden.device, self.proposer
        n = hidden.shape[0]
        mode, padded, _ = drafter_padding(proposer, n)
        proposer.input_ids[:n].copy_(tokens if isinstance(tokens, torch.Tensor) else _to_device(tokens, device),
                                     non_blocking=True)
        positions = _to_device(positions, device)
        if self.runner.uses_mrope:
            set_drafter_positions(proposer, n, rope if rope is not None else positions.unsqueeze(0).expand(3, -1))
        else:
            set_drafter_positions(proposer, n, positions)
        proposer.hidden_states[:n].copy_(hidden)
        drafter_slot_mapping(proposer, padded, _to_device(slots, device))
        return n, padded, mode

    @staticmethod
    def _request_tensors(cm: CommonAttentionMetadata, chunks, num_reqs: int | None = None):
        """Host query_start_loc and seq_lens of ``chunks`` (padded with empty requests to ``num_reqs``), and
        the chunks' block-table rows on the device."""
        pad = (num_reqs or len(chunks)) - len(chunks)
        qsl = torch.tensor([0] + [len(c[1]) for c in chunks] + [0] * pad, dtype=torch.int32).cumsum(0)
        seq_lens_cpu = torch.tensor([c[3] for c in chunks] + [0] * pad, dtype=torch.int32)
        rows = request_rows(cm.block_table_tensor, [c[0] for c in chunks])
        return qsl.to(torch.int32), seq_lens_cpu, rows

    def _metadata(self, cm: CommonAttentionMetadata, chunks, n: int, device_tensors=None):
        """Per-layer attention metadata of ``chunks``: on fresh device tensors, or on ``device_tensors``
        (query_start_loc, seq_lens, block-table rows; possibly padded with empty requests) holding them."""
        device = cm.block_table_tensor.device
        num_reqs = len(chunks) if device_tensors is None else device_tensors[1].numel()
        lens = [len(c[1]) for c in chunks]
        qsl, seq_lens_cpu, rows = self._request_tensors(cm, chunks, num_reqs)
        if device_tensors is None:
            query_start_loc, seq_lens, block_table = (qsl.to(device, non_blocking=True),
                                                      seq_lens_cpu.to(device, non_blocking=True), rows)
        else:
            query_start_loc, seq_lens, block_table = device_tensors
        meta = CommonAttentionMetadata(
            query_start_loc=query_start_loc, query_start_loc_cpu=qsl, seq_lens=seq_lens, num_reqs=num_reqs,
            num_actual_tokens=n, max_query_len=max(lens), max_seq_len=int(seq_lens_cpu.max()),
            block_table_tensor=block_table, slot_mapping=drafter_slot_buffer(self.proposer)[:n],
            _seq_lens_cpu=seq_lens_cpu)
        return self.proposer.build_per_group_and_layer_attn_metadata(meta)[1]

    def _run_model(self, per_layer, forest, padded: int, mode):
        proposer = self.proposer
        with forest_scope(forest), set_forward_context(
                per_layer, self.runner.vllm_config, num_tokens=padded, cudagraph_runtime_mode=mode,
                slot_mapping=drafter_slot_mapping(proposer, padded)):
            return proposer.model(input_ids=proposer.input_ids[:padded], positions=drafter_positions(proposer, padded),
                                  hidden_states=proposer.hidden_states[:padded])

    def _forward(self, cm: CommonAttentionMetadata, chunks, hidden: torch.Tensor, tree_rows=None, rope=None,
                 sampled=None):
        """chunks: per request (req_index, tokens, positions [n], seq_len, slots [n]); hidden: the target or
        MTP hidden state each row's token follows, ``[rows, H]`` in chunk order.

        Returns the MTP hidden states of all rows, in chunk order. The inputs go through the proposer's
        persistent buffers, padded to a captured size, so the MTP layer replays vLLM's piecewise CUDA graphs
        (the attention between the pieces runs eagerly with the tree mask). ``sampled``: as
        :meth:`_write_inputs`."""
        return self._forward_written(cm, chunks, tree_rows, *self._write_inputs(chunks, hidden, rope, sampled))

    def _forward_written(self, cm: CommonAttentionMetadata, chunks, tree_rows, n: int, padded: int, mode,
                         device_rows=None):
        """:meth:`_forward` once :meth:`_write_inputs` has placed the inputs; ``device_rows``: the tree rows
        already on the device (``DeviceTreeRows``) instead of host ``tree_rows``."""
        forest = StepForest(req_ids=[], tree_req_indices=[], parent=None, cu_seqlens=None, tokens=[],
                            attention_rows=tree_rows or [])
        if device_rows is not None:
            forest._device_rows = device_rows
        out = self._run_model(self._metadata(cm, chunks, n), forest, padded, mode)
        # A replayed graph writes its output buffer again on the next forward.
        return out[:n].clone()

    def _tree_level(self, cm: CommonAttentionMetadata, chunks, hidden: torch.Tensor, tree_rows, max_rows=None,
                    rope=None, sampled=None):
        """One tree level: (MTP hidden states ``[n, H]``, top children ``[n, 2k]`` as :meth:`_top_rows`),
        replayed from a full CUDA graph of the level when there is one (``spec_decode/draft_graphs.py``).
        ``sampled``: as :meth:`_write_inputs`."""
        written = self._write_inputs(chunks, hidden, rope, sampled)
        if self.graphs is not None:
            packed = DeviceTreeRows.pack(tree_rows, "cpu", words=self.graphs.words)
            out = self.graphs.level(cm, chunks, (packed.meta, packed.bits), *written, tree_rows=tree_rows,
                                    max_rows=max_rows)
            if out is not None:
                return out
        out = self._forward_written(cm, chunks, tree_rows, *written)
        return out, self._top_rows(out)

    def _top_rows(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """``[rows, 2k]``: the top-k children's probabilities, then their token ids. Probabilities of the top
        tokens only: no full-vocabulary softmax is written. Token ids are exact in float32 (vocabularies
        < 2^24), so one copy to the host carries both. With ``draft_vocab`` the logits, and so the probabilities,
        are those of the draft vocabulary."""
        vocab = self.draft_vocab
        logits = self.proposer.model.compute_logits(hidden_rows) if vocab is None else vocab.logits(hidden_rows)
        return top_children(logits, self.bole_config.topk, None if vocab is None else vocab.ids)

    def _catch_up(self, cm: CommonAttentionMetadata, chunks, hidden: torch.Tensor, rope=None, sampled=None):
        """The MTP forward over the tokens the step committed: (hidden states ``[rows, H]``, their top children
        ``[rows, 2k]`` or None). With drafter graphs, when every chunk is short (an accepted path and its bonus
        token, or a decode) it runs as a tree level whose rows are causal, from a graph; otherwise (prefill
        chunks, no graphs) on vLLM's path, with the top children left to the caller. ``sampled``: as
        :meth:`_write_inputs`."""
        graphs = self.graphs
        if graphs is None or graphs.disabled or max(len(c[1]) for c in chunks) > graphs.catch_up_rows:
            return self._forward(cm, chunks, hidden, rope=rope, sampled=sampled), None
        starts = np.cumsum([0] + [len(c[1]) for c in chunks[:-1]]).tolist()
        tree_rows = [TreeRows(req_index=i, row_start=start, region_mask=_causal(len(c[1])))
                     for i, (start, c) in enumerate(zip(starts, chunks))]
        return self._tree_level(cm, chunks, hidden, tree_rows, max_rows=graphs.catch_up_rows, rope=rope,
                                sampled=sampled)

    def first_pass_all_rows(self, cm: CommonAttentionMetadata, forest: StepForest, next_tokens: torch.Tensor,
                            positions: torch.Tensor, slots: torch.Tensor, sizes: list[int], seq_lens: list[int],
                            hidden: torch.Tensor, rope: torch.Tensor | None = None,
                            top_rows: torch.Tensor | None = None):
        """The MTP forward over every row of a step whose requests are all trees of a verified forest or prefill
        chunks beside them, in batch order: (MTP hidden states ``[n, H]``, top children ``[n, 2k]``). It needs no
        accepted path, so the runner queues it right behind the target forward, before the walk: row i reads the
        target's hidden state at row i and ``next_tokens[i]``, the token that follows row i (a tree node's: the
        token the target emits after it, its argmax for greedy requests; a chunk row's: the next prompt token, or
        the sampled one), and writes row i's MTP K/V at its slot and RoPE position (a tree node's: prefix + depth),
        a tree node seeing its prefix and its ancestors, a chunk row its prefix and the chunk causally. On the
        accepted path that is exactly the catch-up's input; once the runner has moved the path's MTP K/V to
        contiguous slots, the root rows of the next trees are the path ends' rows. ``positions``, ``slots``: the
        verification's ``[n]`` device tensors; ``sizes``, ``seq_lens``: each request's scheduled tokens, and its
        prefix + those (host); ``rope``: its ``[3, n]`` M-RoPE positions where they differ from ``positions``
        (images); ``top_rows``: the rows whose top children a tree may grow from (a step's tree nodes and chunk
        ends), if not all: the LM head skips a prompt chunk's other rows."""
        n = hidden.shape[0]
        if sum(sizes) != n:
            raise ValueError(f"first pass: {len(sizes)} requests of {sum(sizes)} rows, {n} hidden rows")
        qsl = np.cumsum([0] + sizes).tolist()
        chunks = [(r, range(size), None, int(seq_len), None) for r, (size, seq_len) in enumerate(zip(sizes, seq_lens))]
        written = self._write_arrays(next_tokens[:n], positions[:n], slots[:n], hidden,
                                     None if rope is None else rope[:, :n])
        if self._host_tree_rows(hidden):
            out = self._forward_written(cm, chunks, forest.rows(), *written)
            return out, self._top_of(out, top_rows)
        trees = forest.tree_req_indices
        nodes = np.cumsum([0] + [sizes[r] for r in trees]).tolist()
        if nodes[-1] != n:
            # Beside prefill chunks (causal rows, as vLLM runs them): eagerly, with the verification's tree rows
            # (the same token rows and trees)
            out = self._forward_written(cm, chunks, [], *written, device_rows=forest.device_rows(hidden.device))
            return out, self._top_of(out, top_rows)
        # Trees only: the region of each tree is the tree; its bits are the verification's ancestor bits (by node),
        # with a graph-mode forest's bound (fewer graph keys), from a drafter graph where one fits
        meta = torch.tensor([[r, qsl[r], sizes[r], sizes[r], first] for r, first in zip(trees, nodes)],
                            dtype=torch.int32).reshape(-1, 5)
        max_rows = max(forest.max_nodes, max(sizes))
        graph = self.graphs is not None and max_rows <= self.graphs.tree_rows
        return self.forward_device_rows(cm, chunks, meta, forest.device_bits()[:n], written, max_rows, graph)

    def _top_of(self, hidden_rows: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """:meth:`_top_rows` of every row, or of ``rows`` only (the others' left 0)."""
        if rows is None:
            return self._top_rows(hidden_rows)
        top = self._top_rows(hidden_rows[rows])
        out = top.new_zeros((hidden_rows.shape[0], top.shape[1]))
        out[rows] = top
        return out

    def forward_device_rows(self, cm: CommonAttentionMetadata, chunks, meta: torch.Tensor, bits: torch.Tensor,
                            written, max_rows: int, graph: bool = True):
        """(MTP hidden, top children) of rows written by :meth:`_write_arrays`, with tree
        rows given as host ``meta`` and device ``bits`` (``DeviceTreeRows``): from a drafter graph if there is
        one (and ``graph``), else eagerly."""
        if graph and self.graphs is not None:
            out = self.graphs.level(cm, chunks, (meta, bits), *written, max_rows=max_rows)
            if out is not None:
                return out
        device_rows = DeviceTreeRows(meta=meta.to(bits.device, non_blocking=True), bits=bits, num_rows=written[0],
                                     max_rows=max_rows)
        out = self._forward_written(cm, chunks, [], *written, device_rows=device_rows)
        return out, self._top_rows(out)

    @staticmethod
    def _host_tree_rows(hidden: torch.Tensor) -> bool:
        """Whether the attention backend reads tree rows as host masks (the CPU backend recomputes them)."""
        return hidden.device.type == "cpu"

    def _slots(self, r, positions) -> np.ndarray:
        """KV slots of batch request ``r`` at ``positions`` (or of requests ``r`` ``[G, 1]`` at ``[G, n]``
        positions), from the host copy of the MTP group's block table: no device round trip."""
        table = self.runner.input_batch.block_table[self.proposer.kv_cache_gid]
        pos, size = np.asarray(positions, dtype=np.int64), table.block_size
        return table.block_table.np[r, pos // size].astype(np.int64) * size + pos % size

    def _device_slots(self, r: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """:meth:`_slots` on the device, from the MTP group's device block table (positions a device tensor)."""
        table = self.runner.input_batch.block_table[self.proposer.kv_cache_gid]
        size = table.block_size
        blocks = table.block_table.gpu.to(positions.device)
        return blocks[r.expand_as(positions), positions // size].long() * size + positions % size

    def text_offsets(self, reqs) -> list[int] | None:
        """Under M-RoPE, for each of batch requests ``reqs``, how far its text positions run behind the token
        index (vLLM's ``mrope_position_delta``: an image advances the positions by its grid's larger side, not by
        its tokens). A draft node's three positions are its token position plus that offset, as the target's
        and vLLM's own MTP proposer's are. None without M-RoPE or when every offset is 0 (text only)."""
        runner = self.runner
        if not runner.uses_mrope:
            return None
        ids = runner.input_batch.req_ids
        offsets = [runner.requests[ids[r]].mrope_position_delta or 0 for r in reqs]
        return offsets if any(offsets) else None

    def observe_emitted(self, tokens: torch.Tensor) -> None:
        self.draft_vocab.observe(tokens)   # draft_vocab "auto": the subset follows the emitted tokens

    def own_kv_layers(self) -> tuple[str, ...]:
        # The catch-up writes the MTP layer's K/V at every committed position of every request that ran.
        return tuple(getattr(self.proposer, "_draft_attn_layer_names", ()))

    def propose(self, step: DraftStep) -> list[DraftTree]:
        return self.propose_deferred(step)()

    def propose_deferred(self, step: DraftStep):
        """The levels are queued on the device; ``finish()`` waits for the selection only (device beam)."""
        cm = step.common_attn_metadata

        def rows_of(values, hidden):  # rows of a hidden-state tensor, in one gather
            return hidden[torch.tensor(values, dtype=torch.long).to(hidden.device, non_blocking=True)]

        # 1. Catch up on the committed tokens (every request that ran this step keeps its MTP KV in step), unless
        # the first pass over every verified node did (then each path's last row is its root's row).
        all_rows = step.all_rows is not None
        chunks, hidden_rows, last_rows, growing = [], [], [], []
        drafts = drafting(step.contexts)
        for r, fp in enumerate(step.first_pass):
            if fp is None:
                continue
            rows, tokens, positions = fp
            chunks.append((r, tokens, positions, positions[-1] + 1,
                           None if all_rows else self._slots(r, positions).tolist()))
            hidden_rows += rows
            last_rows.append(rows[-1] if all_rows else len(hidden_rows) - 1)
            if drafts[r]:
                growing.append((r, len(chunks) - 1))
        out = [DraftTree() for _ in step.req_ids]
        if not chunks:
            return lambda: out
        if all_rows:
            mtp_hidden, top = step.all_rows
        else:
            # Under M-RoPE after an image, the committed tokens' positions are the target's (step.rope).
            rope = None if step.rope is None else rows_of(hidden_rows, step.rope.T).T
            with record_function_or_nullcontext("bole: catch_up"):
                mtp_hidden, top = self._catch_up(cm, chunks, rows_of(hidden_rows, step.hidden_states), rope,
                                                 self._sampled_rows(step, chunks))
        if not growing:
            return lambda: out
        # 2. Grow the trees from the hidden state that predicts each root's children.
        reqs, roots = [r for r, _ in growing], [chunks[c][2][-1] + 1 for _, c in growing]
        roots_rows = [last_rows[c] for _, c in growing]
        prev = rows_of(roots_rows, mtp_hidden)
        top = rows_of(roots_rows, top) if top is not None else None
        finish = None
        beam = self._beam_for(step)
        if beam is not None:
            try:
                with record_function_or_nullcontext("bole: levels"):
                    finish = beam.grow_deferred(step, cm, reqs, roots, prev, top)
            except Exception as e:  # drafts only: the host bookkeeping grows this step's trees instead
                logger.warning("Bole's device-grown draft levels are off: a level failed (%s: %s); growing them "
                               "on the host", type(e).__name__, e)
                self.beam = self.chain = None
        if finish is None:
            grown = self._grow_on_host(step, cm, reqs, roots, prev, top)
            if step.per_request is not None and step.quotas is None:   # (the runner applies quotas)
                grown = select_step(grown, step.per_request, step.budget)
            finish = lambda: grown  # noqa: E731

        def trees() -> list[DraftTree]:
            for r, tree in zip(reqs, finish()):
                out[r] = tree
            return out

        return trees

    @staticmethod
    def _sampled_rows(step: DraftStep, chunks):
        """``step.sampled`` as (catch-up rows, token ids): each such request's last row of ``chunks``, the row
        order of :meth:`_write_inputs`; None without it."""
        if step.sampled is None:
            return None
        reqs, tokens = step.sampled
        last, row = {}, 0
        for c in chunks:
            row += len(c[1])
            last[c[0]] = row - 1
        picked = _to_device(reqs, tokens.device)
        return [last[r] for r in reqs], tokens.index_select(0, picked)

    def propose_from_walk(self, step: DraftStep, walk, first_pass, positions: torch.Tensor, root_bound: int):
        """:meth:`propose_deferred` before the host knows the accepted paths: the runner's device walk (``walk``,
        ``spec_decode/device_walk.py``) of a forest whose trees are all the step's requests, after
        :meth:`first_pass_all_rows` (``first_pass``) and once the paths' MTP K/V moved. Each tree grows from its
        path end's row, its root at that node's position + 1 (``positions``: the verification's), all on the
        device (the level plan from device roots, bounded by ``root_bound``); needs the device beam."""
        mtp_hidden, top = first_pass
        reqs = [r for r, d in enumerate(drafting(step.contexts)) if d]
        out = [DraftTree() for _ in step.req_ids]
        if not reqs:
            return lambda: out
        last = request_rows(walk.rows.gather(1, (walk.length - 1)[:, None])[:, 0], reqs)
        with record_function_or_nullcontext("bole: levels"):
            finish = self._beam_for(step).grow_deferred(step, step.common_attn_metadata, reqs,
                                                        positions[last].long() + 1, mtp_hidden[last], top[last],
                                                        root_bound)

        def trees() -> list[DraftTree]:
            for r, tree in zip(reqs, finish()):
                out[r] = tree
            return out

        return trees

    def _grow_on_host(self, step: DraftStep, cm, reqs: list[int], roots: list[int], prev: torch.Tensor,
                      top: torch.Tensor | None = None):
        """Trees of batch requests ``reqs`` (root positions ``roots``) grown with host bookkeeping, one MTP
        forward per level and a copy of its top children to the host. A node is expanded only while its children
        could still be kept by the runner's selection (their scores are at most its own): beyond the budget,
        levels cost nothing. ``top``: the roots' top children (:meth:`_top_rows` of ``prev``), if known."""
        trees = {}
        offsets = self.text_offsets(reqs)
        offset_of = dict(zip(reqs, offsets)) if offsets is not None else None
        probs, toks = _children_lists(top if top is not None else self._top_rows(prev), self.bole_config.topk)
        for k, (r, root, p_row, t_row) in enumerate(zip(reqs, roots, probs, toks)):
            g = _Growing(req_index=r, next_pos=root)
            g.add_children(-1, self._child_scores(p_row, 1), t_row)
            g.hidden_row[-1] = k
            trees[r] = g
        for _ in range(self.bole_config.max_depth - 1):
            chunks, hidden_rows, query_parents, row_starts, expanded = [], [], [], [], []
            floors = (selection_floors([g.tree.scores for g in trees.values()], step.per_request, step.budget)
                      if step.per_request is not None else [-np.inf] * len(trees))
            for g, floor in zip(trees.values(), floors):
                best = [n for n in sorted(g.frontier, key=lambda n: -g.tree.scores[n])[: self.bole_config.topk]
                        if g.tree.scores[n] > floor]
                g.frontier = []
                if not best:
                    continue
                for n in best:
                    g.query_of[n] = len(g.query_of)
                n_queries = len(g.query_of)
                row_starts.append(len(hidden_rows))
                hidden_rows += [g.hidden_row[g.tree.parents[n]] for n in best]
                chunks.append((g.req_index, [g.tree.tokens[n] for n in best],
                               [g.next_pos + g.depth[n] - 1 for n in best], g.next_pos + n_queries,
                               self._slots(g.req_index, [g.next_pos + g.query_of[n] for n in best]).tolist()))
                query_parents.append(self._query_parents(g, n_queries))
                expanded.append((g, best))
            if not chunks:
                break
            # Each new query sees the queries of its expanded ancestors and itself; one mask build per level.
            tree_rows = [TreeRows(req_index=c, row_start=start, region_mask=mask[[g.query_of[n] for n in best]])
                         for c, (start, mask, (g, best)) in enumerate(
                             zip(row_starts, ancestor_masks(query_parents), expanded))]
            hidden = prev[torch.tensor(hidden_rows, dtype=torch.long).to(prev.device, non_blocking=True)]
            rope = None
            if offset_of is not None:
                rope = _to_device([p + offset_of[c[0]] for c in chunks for p in c[2]], prev.device)
                rope = rope.unsqueeze(0).expand(3, -1)
            prev, top = self._tree_level(cm, chunks, hidden, tree_rows, rope=rope)
            probs, toks = _children_lists(top, self.bole_config.topk)
            i = 0
            for g, best in expanded:
                for n in best:
                    g.hidden_row[n] = i
                    g.add_children(n, self._child_scores(probs[i], g.depth[n] + 1), toks[i])
                    i += 1
        return [trees[r].tree for r in reqs]

    @staticmethod
    def _query_parents(g: _Growing, n_queries: int) -> list[int]:
        """Parent of each of a request's MTP queries among its queries (-1: a child of the root)."""
        query_parent = [-1] * n_queries
        for n, q in g.query_of.items():
            p = g.tree.parents[n]
            query_parent[q] = g.query_of[p] if p >= 0 else -1
        return query_parent
