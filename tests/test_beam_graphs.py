"""Whole-level graphs of the device beam (spec_decode/beam_graphs.py), on CPU with a stand-in capture whose
replay calls the captured function again: what a CUDA graph replays, provided every per-step value comes from
the fixed buffers (a value baked into the closure at capture would show up as a wrong tree in a later step).
Each step's trees and level inputs are checked against the beam's eager CPU branch on the same requests."""

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.config import CUDAGraphMode

from test_device_beam import _case, _stand_in
from vllm_bole.spec_decode import beam_graphs
from vllm_bole.spec_decode.device_beam import DeviceBeam
from vllm_bole.spec_decode.drafter import DraftStep

MAX_REQS = 16
BLOCKS = torch.arange(MAX_REQS * 8, dtype=torch.int32).view(MAX_REQS, 8) * 3


def _beam(drafter) -> DeviceBeam:
    """The drafter's device beam with its whole-level graphs, as the MTP drafter sets them up on a GPU."""
    beam = DeviceBeam(drafter)
    beam.graphs = beam_graphs.BeamGraphs(beam)
    return beam


def _graph_drafter(k, depth, synthetic):
    """The stand-in drafter with the proposer buffers, model call and metadata a beam graph uses."""
    drafter = _stand_in(k, depth, synthetic)
    size = MAX_REQS * k + 5
    proposer = SimpleNamespace(input_ids=torch.zeros(size, dtype=torch.long), hidden_states=torch.zeros(size, 1),
                               positions=torch.zeros(size, dtype=torch.long),
                               slots=torch.full((size,), -7, dtype=torch.long))
    proposer._set_positions = lambda n, pos: proposer.positions[:n].copy_(pos)

    def slot_mapping(padded, slots):
        proposer.slots[:slots.shape[0]].copy_(slots)
        proposer.slots[slots.shape[0]:padded] = -1

    proposer._get_slot_mapping = slot_mapping
    proposer._determine_batch_execution_and_padding = lambda n: (CUDAGraphMode.PIECEWISE, n + 3, None)
    drafter.proposer = proposer
    drafter.runner = SimpleNamespace(max_num_reqs=MAX_REQS, device=torch.device("cpu"), max_model_len=4096,
                                     uses_mrope=False)
    drafter.graphs = SimpleNamespace(pool=None)      # the drafter level graphs: only their pool is shared
    drafter._metadata = lambda cm, chunks, n, views: {"rows": n, "reqs": views[1].numel()}
    drafter.graph_levels = []

    def run_model(per_layer, forest, padded, mode):
        """The stand-in MTP layer on what the graph wrote; rows past the real ones come out NaN (stale)."""
        assert mode == CUDAGraphMode.NONE and forest.graph.num_tokens == padded
        rows = forest._device_rows
        meta = rows.meta[rows.meta[:, 2] > 0]
        real = int(meta[:, 2].sum())
        d = int(meta[0, 3]) // k
        graphs = drafter.beam.graphs
        tokens = proposer.input_ids[:real].tolist()
        hid = proposer.hidden_states[:real, 0].tolist()
        drafter.graph_levels.append({
            "tokens": tokens, "positions": proposer.positions[:real].tolist(),
            "slots": proposer.slots[:real].tolist(), "hidden": hid,
            "seq_lens": graphs.seq_lens[d - 1, :meta.shape[0]].tolist(),
            "padding_slots": proposer.slots[real:padded].tolist(),
            "meta": meta.tolist(), "bits": rows.bits[:real].tolist()})
        out = torch.full((padded, 1), float("nan"))
        out[:real, 0] = torch.tensor([(h * 1000003 + t) % (1 << 22) for h, t in zip(hid, tokens)])
        return out

    drafter._run_model = run_model
    return drafter


@pytest.fixture
def stand_in_capture(monkeypatch):
    captured = []

    def capture(call, pool):
        captured.append(pool)
        return SimpleNamespace(replay=call), None

    monkeypatch.setattr(beam_graphs, "capture", capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    return captured


def _eager(k, depth, synthetic, reqs, roots, hidden, per_request, budget):
    drafter = _stand_in(k, depth, synthetic)
    step = DraftStep(req_ids=[], contexts=[], per_request=per_request, budget=budget)
    trees = DeviceBeam(drafter).grow(step, None, reqs, roots, hidden)
    return trees, drafter.levels


def _grow_and_check(drafter, step, cm, reqs, rng, case, device_roots) -> int:
    """One step of the graph beam on new roots: its trees and every level's inputs are the eager beam's (the
    level plan from device roots fills the graphs' buffers on the device). Returns the levels run."""
    k, depth, synthetic = case
    roots = [rng.randint(1, 700) for _ in reqs]
    hidden = torch.tensor([[float(rng.randint(1, 10**6))] for _ in reqs])
    want, want_levels = _eager(k, depth, synthetic, reqs, roots, hidden, step.per_request, step.budget)
    drafter.graph_levels = []
    if device_roots:
        got = drafter.beam.grow(step, cm, reqs, torch.tensor(roots), hidden, root_bound=max(roots))
    else:
        got = drafter.beam.grow(step, cm, reqs, roots, hidden)
    assert [(t.tokens, t.parents, t.scores) for t in got] == [(t.tokens, t.parents, t.scores) for t in want]
    assert len(drafter.graph_levels) == len(want_levels)
    for level, w in zip(drafter.graph_levels, want_levels):
        for name in ("tokens", "positions", "slots", "hidden", "meta"):
            assert level[name] == w[name], name
        assert level["seq_lens"] == [c[2] for c in w["chunks"]]
        assert level["bits"] == [b[:len(level["bits"][0])] for b in w["bits"]]
        assert all(s == -1 for s in level["padding_slots"])     # padding requests write no KV
    assert torch.equal(drafter.beam.graphs.block_table[:len(reqs)], BLOCKS[reqs])
    # The rows whose MTP outputs the levels keep (padding requests' are zeroed): the real requests' queries.
    bucket = 1 << (len(reqs) - 1).bit_length()
    assert drafter.beam.graphs.real_rows[:bucket * k].tolist() == [i < len(reqs) * k for i in range(bucket * k)]
    return len(want_levels)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("per_request,budget", [(32, 64), (6, 9), (3, 40)])
@pytest.mark.parametrize("device_roots", [False, True])
def test_graph_levels_grow_the_eager_trees_across_steps(seed, per_request, budget, device_roots, stand_in_capture):
    k, depth, _, _, synthetic = _case(seed)
    rng = random.Random(100 + seed)
    drafter = _graph_drafter(k, depth, synthetic)
    beam = _beam(drafter)
    drafter.beam = beam
    assert beam.graphs is not None
    beam.host_rows = lambda hidden: False
    cm = SimpleNamespace(block_table_tensor=BLOCKS)
    step = DraftStep(req_ids=[], contexts=[], per_request=per_request, budget=budget)
    levels_seen = 0
    for _ in range(5):   # several steps: request counts within one bucket and across buckets, new roots
        reqs = sorted(rng.sample(range(12), rng.randint(1, 7)))
        levels_seen += _grow_and_check(drafter, step, cm, reqs, rng, (k, depth, synthetic), device_roots)
    graphs = beam.graphs
    # Every level ran from a graph: captured on first use (run eagerly then), replayed afterwards.
    assert len(graphs.graphs) + graphs.replays == levels_seen
    assert len(stand_in_capture) == len(graphs.graphs) and all(p == "pool" for p in stand_in_capture)
    assert all(key[0] in (1, 2, 4, 8) for key in graphs.graphs)


@pytest.mark.parametrize("device_roots", [False, True])
def test_repeated_step_shapes_reuse_the_written_layout(device_roots, stand_in_capture):
    """Steps of one shape in a row (async scheduling) skip rewriting the row layout the buffers hold; a step of
    another shape (fewer requests in the same bucket, a gathered request list, then the first shape again)
    rewrites it: every step's trees and level inputs stay the eager ones."""
    k, depth, _, _, synthetic = _case(3)
    rng = random.Random(7)
    drafter = _graph_drafter(k, depth, synthetic)
    beam = drafter.beam = _beam(drafter)
    beam.host_rows = lambda hidden: False
    cm = SimpleNamespace(block_table_tensor=BLOCKS)
    step = DraftStep(req_ids=[], contexts=[], per_request=6, budget=20)
    layouts = []
    for reqs in ([0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2], [1, 5, 6, 9], [0, 1, 2, 3], [0, 1, 2, 3]):
        _grow_and_check(drafter, step, cm, reqs, rng, (k, depth, synthetic), device_roots)
        layouts.append(beam.graphs._layout)
    assert layouts[0] == layouts[1] == layouts[3] and layouts[2] != layouts[0]


def test_capture_failure_keeps_the_level_and_runs_later_levels_eagerly(monkeypatch):
    k, depth, synthetic = 2, 5, None
    drafter = _graph_drafter(k, depth, synthetic)
    beam = _beam(drafter)
    drafter.beam = beam
    beam.host_rows = lambda hidden: False

    def failing_capture(call, pool):
        raise RuntimeError("capture failed")

    monkeypatch.setattr(beam_graphs, "capture", failing_capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    eager_rows = []

    def forward_written(cm, chunks, tree_rows, n, padded, mode, device_rows=None):   # the eager route
        tokens, positions, slots, hid = drafter._written
        eager_rows.append(n)
        return torch.tensor([(h * 1000003 + t) % (1 << 22) for h, t in zip(hid, tokens)],
                            dtype=torch.float32)[:, None]

    drafter._forward_written = forward_written
    reqs, roots = [0, 3, 5], [10, 20, 30]
    hidden = torch.tensor([[11.0], [12.0], [13.0]])
    want, want_levels = _eager(k, depth, synthetic, reqs, roots, hidden, None, None)
    drafter.graphs.level = lambda *args, **kwargs: None      # no drafter level graph either
    got = beam.grow(DraftStep(req_ids=[], contexts=[]), SimpleNamespace(block_table_tensor=BLOCKS), reqs, roots,
                    hidden)
    assert [(t.tokens, t.parents) for t in got] == [(t.tokens, t.parents) for t in want]
    assert beam.graphs.disabled and not beam.graphs.graphs
    # Level 1 ran once (the graph's eager warm-up), the others eagerly over the step's real rows only.
    assert len(drafter.graph_levels) == 1 and eager_rows == [len(reqs) * k] * (len(want_levels) - 1)
    assert np.isfinite(beam.graphs.state.hid.numpy()).all()
