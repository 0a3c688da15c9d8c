"""Full CUDA graphs of the device beam's whole levels (GPU): no host work between levels but one replay.

A level of ``DeviceBeam`` is its MTP forward plus a few dozen small device ops (gather the frontier's inputs,
pack its ancestor bits, the LM head's top children, score, sort, update the frontier). Run eagerly, their
launches and the level's metadata cost the host more than the GPU spends on the level. Here one graph per
(padded request count, level, attention route) holds all of it, captured the first time its key occurs:

- the beam's state (``BeamState``) lives in fixed buffers, ``max_num_reqs`` rows, which a level reads and
  updates in place;
- what a level reads from the host (positions, KV slots, lengths and row metadata of every level: ``LevelPlan``;
  query_start_loc; the block-table rows) is written into fixed buffers once per step, before the first level;
- requests are padded to a power of two with empty ones (no query rows in the metadata, KV slot -1, their MTP
  hidden states zeroed), so a graph serves every request count up to its bucket.

On first use a level runs eagerly (it is this step's level; Triton compiles there) and is then captured; the
capture does not run it again. A level's graph also computes its early-stop flag (``selection_alive``, with the
step's budget as data and the padding requests left out); the host copies it out and reads it one level late.
"""

import time

import numpy as np
import torch
from vllm.config import CUDAGraphMode
from vllm.utils.math_utils import next_power_of_2
from vllm.v1.spec_decode.utils import PADDING_SLOT_ID

from .._vllm_compat import drafter_padding, drafter_slot_mapping, set_drafter_positions
from ..attention.graph_mode import GraphStep, capture
from ..attention.tree_attn_gpu import reads_prefix_itself
from ..logger import init_logger
from ..step.forest import DeviceTreeRows, StepForest
from .device_beam import BeamState, LevelPlan, request_rows, selection_alive

logger = init_logger(__name__)

MAX_GRAPHS = 384   # as the other graph kinds; buckets x levels x routes is about a hundred


class BeamGraphs:
    def __init__(self, beam):
        self.beam = beam
        drafter = beam.drafter
        self.drafter, self.k = drafter, beam.k
        runner = drafter.runner
        self.max_reqs, self.levels_max, dev = runner.max_num_reqs, max(beam.max_depth - 1, 1), runner.device
        rows = self.max_reqs * self.k
        self.query_start_loc = torch.zeros(self.max_reqs + 1, dtype=torch.int32, device=dev)
        self.real_rows = torch.zeros(rows, dtype=torch.bool, device=dev)   # the step's query rows of real requests
        self.seq_lens = torch.zeros(self.levels_max, self.max_reqs, dtype=torch.int32, device=dev)
        self.meta = torch.zeros(self.levels_max, self.max_reqs, 5, dtype=torch.int32, device=dev)
        self.positions = torch.zeros(self.levels_max, rows, dtype=torch.long, device=dev)
        self.slots = torch.full((self.levels_max, rows), PADDING_SLOT_ID, dtype=torch.long, device=dev)
        self.block_table = None     # [max_reqs, blocks] once the KV cache exists
        self.budget = torch.zeros((), dtype=torch.long, device=dev)           # the step's node budget
        self.flags = torch.zeros(self.levels_max, dtype=torch.bool, device=dev)   # per level: selection_alive
        self.state: BeamState | None = None   # [max_reqs] rows, at the first step (hidden size and dtype)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.replays = 0
        self.capture_ms = 0.0   # host time spent capturing (this step's eager level included), all captures
        self.disabled = False
        self._full_logged = False
        self._step = None           # (request bucket, padded rows) of the step being grown
        self._layout = None         # (requests, bucket, levels) whose row layout the buffers hold
        self._budget_value = None   # the budget the buffer holds

    def start(self, cm, reqs: list[int], plan: LevelPlan, hidden: torch.Tensor, top: torch.Tensor,
              budget: int | None = None):
        """The step's inputs into the fixed buffers and the root's children into the fixed state; returns that
        state (``bucket`` rows) or None when the step's levels cannot run from graphs."""
        k, g = self.k, len(reqs)
        if self.disabled or g > self.max_reqs:
            return None
        bucket = next_power_of_2(g) if next_power_of_2(g) <= self.max_reqs else g
        mode, padded, _ = drafter_padding(self.drafter.proposer, bucket * k)
        if mode != CUDAGraphMode.PIECEWISE:
            return None
        if self.state is None:
            m = k + self.levels_max * k * k
            self.state = BeamState.empty(self.max_reqs, m, k, self.beam.max_depth, hidden)
        if self.block_table is None:
            self.block_table = torch.zeros_like(cm.block_table_tensor[:1]).expand(self.max_reqs, -1).contiguous()
        levels, rows = plan.seq_lens.shape[0], g * k
        # The row layout (query_start_loc, tree-row metadata, padding rows) depends on (g, bucket, levels) alone
        # (LevelPlan.meta): a step of the same shape as the last one finds it in the buffers already.
        shape = (g, bucket, levels)
        same_shape = shape == self._layout
        if not same_shape:
            # Padding requests: no query rows (meta rows 0, its own batch index), no keys, KV slot -1.
            qsl = np.full(bucket + 1, rows, dtype=np.int32)
            qsl[:g + 1] = np.arange(g + 1) * k
            meta = np.zeros((levels, bucket, 5), dtype=np.int32)
            meta[:, :g] = plan.meta
            meta[:, g:, 0] = np.arange(g, bucket)
            self.query_start_loc[:bucket + 1].copy_(torch.from_numpy(qsl), non_blocking=True)
            self.real_rows[:bucket * k].copy_(torch.from_numpy(np.arange(bucket * k) < rows), non_blocking=True)
            self.meta[:levels, :bucket].copy_(torch.from_numpy(meta), non_blocking=True)
        budget = budget if budget is not None else 1 << 40
        if budget != self._budget_value:
            self.budget.fill_(budget)
            self._budget_value = budget
        if isinstance(plan.seq_lens, torch.Tensor):   # from device roots: device to device
            if not same_shape:
                self.seq_lens[:levels, g:bucket].zero_()
                self.positions[:levels, rows:bucket * k].zero_()
                self.slots[:levels, rows:bucket * k].fill_(PADDING_SLOT_ID)
            self.seq_lens[:levels, :g].copy_(plan.seq_lens)
            self.positions[:levels, :rows].copy_(plan.rope_positions)
            self.slots[:levels, :rows].copy_(plan.slots)
        else:
            seq_lens = np.zeros((levels, bucket), dtype=np.int32)
            seq_lens[:, :g] = plan.seq_lens
            pos_slots = np.zeros((2, levels, bucket * k), dtype=np.int64)
            pos_slots[1] = PADDING_SLOT_ID
            pos_slots[0, :, :rows], pos_slots[1, :, :rows] = plan.rope_positions, plan.slots
            self.seq_lens[:levels, :bucket].copy_(torch.from_numpy(seq_lens), non_blocking=True)
            pos_slots = torch.from_numpy(pos_slots).to(hidden.device, non_blocking=True)
            self.positions[:levels, :bucket * k].copy_(pos_slots[0])
            self.slots[:levels, :bucket * k].copy_(pos_slots[1])
        self._layout = shape
        self.block_table[:g].copy_(request_rows(cm.block_table_tensor, reqs))
        state = self.state.rows(bucket)
        if bucket > g:
            hidden = torch.cat([hidden, hidden.new_zeros(bucket - g, hidden.shape[1])])
            top = torch.cat([top, top.new_zeros(bucket - g, top.shape[1])])
        self.beam.start(state, hidden, top)
        self._step = (bucket, padded)
        return state

    def run(self, state: BeamState, d: int, cm, reqs: list[int], plan: LevelPlan, per_request: int | None) -> bool:
        """Level ``d`` of the step :meth:`start` set up, from its graph (captured now if new: the eager warm-up
        is this step's level), and its early-stop flag (:meth:`flag`) unless ``per_request`` is None. False
        when it did not run (too many graphs, graphs off): the caller runs it."""
        if self.disabled:
            return False
        bucket, padded = self._step
        long_prefix = not reads_prefix_itself(plan.seq_max[d - 1], padded)
        key = (bucket, d, long_prefix, per_request)
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            self.replays += 1
            return True
        if len(self.graphs) >= MAX_GRAPHS:
            if not self._full_logged:
                logger.info("Bole holds %d drafter beam CUDA graphs; new level shapes run eagerly", MAX_GRAPHS)
                self._full_logged = True
            return False
        start = time.perf_counter()
        k = self.k
        chunks = [(r, range(k), None, s, None) for r, s in zip(reqs, plan.host_seq_lens(d))]
        views = (self.query_start_loc[:bucket + 1], self.seq_lens[d - 1, :bucket], self.block_table[:bucket])
        per_layer = self.drafter._metadata(cm, chunks, bucket * k, views)

        def call():
            self.beam.level(state, d, lambda tok, hid, visible, bits: self._forward(bucket, d, padded, long_prefix,
                                                                                    per_layer, tok, hid, bits))
            if per_request is not None:
                real = self.real_rows[:bucket * k:k]   # request g is real iff its first query row is
                n = k + d * k * k
                self.flags[d - 1].copy_(selection_alive(state.scores[:, :n], state.front_score, per_request,
                                                        self.budget, real))

        call()    # this step's level, eagerly
        drafter_graphs = self.drafter.graphs
        if drafter_graphs.pool is None:
            drafter_graphs.pool = torch.cuda.graph_pool_handle()
        try:
            torch.cuda.synchronize()
            self.graphs[key] = capture(call, drafter_graphs.pool)[0]
        except Exception as e:  # later levels run eagerly; this one already ran
            logger.warning("Bole's drafter beam CUDA graphs are off: capturing a level failed (%s: %s)",
                           type(e).__name__, e)
            self.disabled = True
            return True
        spent_ms = (time.perf_counter() - start) * 1e3
        self.capture_ms += spent_ms
        logger.debug("Bole captured the beam level graph (%d requests, level %d) in %.0f ms", bucket, d, spent_ms)
        if len(self.graphs) == 1:
            logger.info("Bole grows draft trees from full CUDA graphs of whole levels (captured per request "
                        "bucket, level and prefix route on first use)")
        return True

    def flag(self, d: int):
        """Level ``d``'s early-stop flag, computed in its graph, on its way to the host (``DeviceBeam.send_flag``)."""
        return self.beam.send_flag(self.flags[d - 1], d)

    def _forward(self, bucket: int, d: int, padded: int, long_prefix: bool, per_layer, tokens: torch.Tensor,
                 hidden: torch.Tensor, bits: torch.Tensor):
        """Level ``d``'s MTP forward from the fixed buffers (device work only): (hidden, top children)."""
        drafter, proposer, k = self.drafter, self.drafter.proposer, self.k
        n = bucket * k
        proposer.input_ids[:n].copy_(tokens)
        positions = self.positions[d - 1, :n]
        set_drafter_positions(proposer, n, positions.unsqueeze(0).expand(3, -1) if drafter.runner.uses_mrope
                              else positions)
        proposer.hidden_states[:n].copy_(hidden)
        drafter_slot_mapping(proposer, padded, self.slots[d - 1, :n])
        forest = StepForest(req_ids=[], tree_req_indices=[], parent=None, cu_seqlens=None, tokens=[],
                            attention_rows=[], graph=GraphStep(
                                num_tokens=padded, num_reqs=bucket, max_nodes=k, long_prefix=long_prefix,
                                max_model_len=drafter.runner.max_model_len, block_tables={}, scratch_storage={}))
        forest._device_rows = DeviceTreeRows(meta=self.meta[d - 1, :bucket],
                                             bits=bits,
                                             num_rows=padded, max_rows=k)
        out = drafter._run_model(per_layer, forest, padded, CUDAGraphMode.NONE)[:n]
        # Padding requests' rows attend to nothing (stale outputs): zeros keep their top children finite.
        out = torch.where(self.real_rows[:n, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
        return out, drafter._top_rows(out)
