"""What a drafter level graph reads, written before each replay (spec_decode/draft_graphs.py): the level's
query_start_loc, seq_lens and block-table rows over the power-of-two request bucket, and its tree rows (meta and
bits) as the host bookkeeping packs them or as the device beam builds them. The capture itself needs a GPU; here
it is a stand-in that snapshots the buffers at every replay."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.config import CUDAGraphMode

from vllm_bole.kernels.forest import pack_bits
from vllm_bole.spec_decode.draft_graphs import DraftGraphs
from vllm_bole.spec_decode.mtp_tree_drafter import MTPTreeDrafter
from vllm_bole.step.forest import DeviceTreeRows, TreeRows


def _graphs(k=2, depth=3, max_reqs=8):
    drafter = SimpleNamespace(
        runner=SimpleNamespace(max_num_reqs=max_reqs, device=torch.device("cpu"), max_model_len=512),
        bole_config=SimpleNamespace(topk=k, max_depth=depth, max_nodes_per_request=depth * k),
        _request_tensors=MTPTreeDrafter._request_tensors, _metadata=lambda *args: "per-layer metadata",
        proposer=SimpleNamespace(_slot_mapping_buffer=torch.arange(64)))
    graphs = DraftGraphs(drafter)
    snapshots, captures = [], []

    def capture(key, per_layer, tree_rows, padded):
        captures.append((key, per_layer, padded))
        buffers = (graphs.query_start_loc, graphs.seq_lens, graphs.block_table, graphs.meta, graphs.bits)
        outputs = (torch.arange(padded, dtype=torch.float32)[:, None], torch.ones(padded, 2 * k))
        entry = (SimpleNamespace(replay=lambda: snapshots.append([b.clone() for b in buffers])), outputs)
        graphs.graphs[key] = entry
        return entry

    graphs._capture = capture
    return graphs, snapshots, captures


@pytest.mark.parametrize("device_rows", [False, True])
def test_level_fills_the_graph_buffers(device_rows):
    k, depth = 2, 3
    graphs, snapshots, captures = _graphs(k, depth)
    cm = SimpleNamespace(block_table_tensor=torch.arange(8 * 4, dtype=torch.int32).view(8, 4))
    reqs, seq_lens, d = [5, 2, 7], [40, 700, 13], 2           # three requests: bucket 4, one empty request
    chunks = [(r, range(k), None, s, None) for r, s in zip(reqs, seq_lens)]
    masks = [torch.rand(k, d * k) < 0.5 for _ in reqs]
    if device_rows:   # as DeviceBeam._run_level builds them
        c = np.arange(len(reqs), dtype=np.int32)
        meta = torch.from_numpy(np.stack([c, c * k, np.full(3, k), np.full(3, d * k), c * k], 1).astype(np.int32))
        rows = (meta, pack_bits(torch.cat(masks), graphs.words))
    else:             # as MTPTreeDrafter._tree_level packs host rows
        packed = DeviceTreeRows.pack([TreeRows(req_index=i, row_start=i * k, region_mask=m)
                                      for i, m in enumerate(masks)], "cpu", words=graphs.words)
        rows = (packed.meta, packed.bits)
    n = k * len(reqs)
    hidden, top = graphs.level(cm, chunks, rows, n, 8, CUDAGraphMode.PIECEWISE)
    assert hidden.shape[0] == n and top.shape == (n, 2 * k)
    assert [c[0] for c in captures] == [(8, 4, True, k)]       # 700 > the inline-prefix threshold; k rows
    qsl, lens, table, meta, bits = snapshots[-1]
    assert qsl[:5].tolist() == [0, 2, 4, 6, 6]
    assert lens[:4].tolist() == seq_lens + [0]
    assert torch.equal(table[:3], cm.block_table_tensor[reqs])
    assert meta[:3].tolist() == [[i, i * k, k, d * k, i * k] for i in range(3)]
    assert meta[3].tolist() == [3, 0, 0, 0, 0]                 # the empty request: its own batch index
    assert torch.equal(bits[:n], pack_bits(torch.cat(masks), graphs.words))
    # Same key again: replayed, not captured; another request count pads to its own bucket.
    graphs.level(cm, chunks, rows, n, 8, CUDAGraphMode.PIECEWISE)
    assert len(captures) == 1 and graphs.replays == 2
    assert graphs.level(cm, chunks, rows, n, 8, CUDAGraphMode.NONE) is None


def test_catch_up_runs_short_chunks_as_causal_tree_rows():
    """The drafter's catch-up forward: accepted paths (at most depth + 1 tokens) through a level graph whose rows
    are causal; a longer chunk (a prefill) on vLLM's path."""
    k, depth = 2, 3
    graphs, snapshots, captures = _graphs(k, depth)
    drafter = MTPTreeDrafter.__new__(MTPTreeDrafter)
    drafter.bole_config, drafter.graphs = SimpleNamespace(topk=k, max_depth=depth), graphs
    graphs.drafter = SimpleNamespace(runner=graphs.drafter.runner, bole_config=drafter.bole_config,
                                     _request_tensors=MTPTreeDrafter._request_tensors, _metadata=lambda *a: None)
    drafter._write_arrays = lambda tokens, positions, slots, hidden, rope=None: (hidden.shape[0], 8,
                                                                                   CUDAGraphMode.PIECEWISE)
    vllm_path = []
    drafter._forward = lambda cm, chunks, hidden, rope=None, sampled=None: vllm_path.append(chunks) or hidden
    cm = SimpleNamespace(block_table_tensor=torch.arange(8 * 4, dtype=torch.int32).view(8, 4))
    lens = [4, 1, 3]
    chunks = [(r, list(range(n)), list(range(30, 30 + n)), 30 + n, list(range(n))) for r, n in zip([1, 6, 3], lens)]
    hidden, top = drafter._catch_up(cm, chunks, torch.zeros(sum(lens), 1))
    assert not vllm_path and top is not None and hidden.shape[0] == sum(lens)
    assert [c[0] for c in captures] == [(8, 4, False, depth + 1)]
    _, _, _, meta, bits = snapshots[-1]
    starts = [0, 4, 5]
    assert meta[:3].tolist() == [[i, s, n, n, s] for i, (s, n) in enumerate(zip(starts, lens))]
    causal = torch.zeros(sum(lens), max(lens), dtype=torch.bool)
    for s, n in zip(starts, lens):
        causal[s:s + n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
    assert torch.equal(bits[:sum(lens)], pack_bits(causal, graphs.words))
    long = [(2, list(range(depth + 2)), list(range(depth + 2)), depth + 2, list(range(depth + 2)))]
    hidden, top = drafter._catch_up(cm, long, torch.zeros(depth + 2, 1))
    assert vllm_path == [long] and top is None


def test_sampled_tokens_land_on_their_requests_last_catch_up_rows():
    """After a step without trees the catch-up's rows of a request end in a stand-in for its sampled token
    (DraftStep.sampled: batch requests and every batch request's token on the device); the drafter writes each over
    its request's last row, in the row order its chunks are written in."""
    from vllm_bole.spec_decode.drafter import DraftStep

    drafter = MTPTreeDrafter.__new__(MTPTreeDrafter)
    drafter.proposer = SimpleNamespace(input_ids=torch.zeros(16, dtype=torch.int32))
    drafter._write_arrays = lambda tokens, positions, slots, hidden, rope=None: (
        drafter.proposer.input_ids[:len(tokens)].copy_(torch.tensor(tokens)), (len(tokens), 16, None))[1]
    lens, reqs = [4, 1, 3], [1, 6, 3]        # batch requests 1, 6 and 3; 1 and 3 sampled a token
    chunks = [(r, [5] * (n - 1) + [0], list(range(n)), n, list(range(n))) for r, n in zip(reqs, lens)]
    sampled = torch.arange(100, 108)          # one token per batch request
    step = DraftStep(req_ids=[str(i) for i in range(8)], contexts=[None] * 8, sampled=([1, 3], sampled))
    rows = MTPTreeDrafter._sampled_rows(step, chunks)
    assert rows[0] == [3, 7] and rows[1].tolist() == [101, 103]
    assert drafter._write_inputs(chunks, torch.zeros(8, 1), sampled=rows) == (8, 16, None)
    assert drafter.proposer.input_ids[:8].tolist() == [5, 5, 5, 101, 0, 5, 5, 103]
    assert MTPTreeDrafter._sampled_rows(DraftStep(req_ids=[], contexts=[]), chunks) is None


def test_a_new_level_size_replays_a_held_larger_graph_until_it_recurs(monkeypatch):
    """A level whose padded size has no graph yet replays a held one of the same requests, route and rows per
    request with a few more tokens (its extra rows with KV slot -1), and gets its own at the CAPTURE_AFTER-th
    occurrence once the stand-ins' padding has cost CAPTURE_COST_STEPS (here: one step, every row counted and
    nothing else)."""
    from vllm_bole.attention import graph_mode

    monkeypatch.setattr(graph_mode, "CAPTURE_AFTER", 2)
    for name, value in (("FLAT_ROWS", 0), ("FIXED_ROWS", 0), ("MAX_PAD_COST", 2.0), ("CAPTURE_COST_STEPS", 1.0)):
        monkeypatch.setattr(graph_mode, name, value)
    k = 2
    graphs, snapshots, captures = _graphs(k)
    slots = graphs.drafter.proposer._slot_mapping_buffer
    cm = SimpleNamespace(block_table_tensor=torch.arange(8 * 4, dtype=torch.int32).view(8, 4))
    chunks = [(r, range(k), None, 40, None) for r in (0, 1, 2)]
    packed = DeviceTreeRows.pack([TreeRows(req_index=i, row_start=i * k, region_mask=torch.ones(k, k, dtype=bool))
                                  for i in range(3)], "cpu", words=graphs.words)
    rows = (packed.meta, packed.bits)
    graphs.level(cm, chunks, rows, 6, 16, CUDAGraphMode.PIECEWISE)
    assert [c[0] for c in captures] == [(16, 4, False, k)]
    hidden, top = graphs.level(cm, chunks, rows, 6, 8, CUDAGraphMode.PIECEWISE)
    assert hidden.shape[0] == 6 and top.shape[0] == 6 and len(captures) == 1 and graphs.stand_ins.replays == 1
    assert slots[:8].tolist() == list(range(8)) and slots[8:16].tolist() == [-1] * 8 and slots[16] == 16
    graphs.level(cm, chunks, rows, 6, 8, CUDAGraphMode.PIECEWISE)   # the second time: its own graph
    assert [c[0] for c in captures] == [(16, 4, False, k), (8, 4, False, k)] and graphs.stand_ins.replays == 1
