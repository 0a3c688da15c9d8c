"""The MTP drafter's device-grown levels (spec_decode/device_beam.py) against its host bookkeeping: the same
queries, positions, KV slots, lengths and ancestor rows level by level, the same trees, and the same selection
once the host's pruning applies. The MTP forward is a stand-in whose output depends only on the query's token
and input hidden state, and whose children's probabilities are powers of two (exact products, many ties)."""

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_bole.kernels.forest import pack_bits
from vllm_bole.spec_decode.device_beam import DeviceBeam, selected_mask, selection_alive, trees_of_selection
from vllm_bole.spec_decode.drafter import DraftStep
from vllm_bole.spec_decode.mtp_tree_drafter import MTPTreeDrafter
from vllm_bole.spec_decode.synthetic import SyntheticAcceptance
from vllm_bole.spec_decode.tree import DraftTree, select_step, selection_floors
from vllm_bole.step.forest import DeviceTreeRows

PROBS = np.array([0.5, 0.25, 0.125, 0.0625])


def _stand_in(k, depth, synthetic=None):
    """An MTPTreeDrafter without an engine: writes, forwards and top children recorded and faked."""
    drafter = MTPTreeDrafter.__new__(MTPTreeDrafter)
    drafter.bole_config = SimpleNamespace(topk=k, max_depth=depth, max_nodes_per_request=depth * k)
    drafter.synthetic, drafter._synthetic_scores, drafter.graphs = synthetic, {}, None
    drafter.levels = []
    words = -(-(depth * k + 1) // 32)

    def top_rows(hidden):
        rows = []
        for h in hidden[:, 0].tolist():
            rng = np.random.default_rng(int(h))
            p = np.sort(rng.choice(PROBS, size=k))[::-1]
            tok = rng.choice(1 << 20, size=k, replace=False)
            rows.append(np.concatenate([p, tok]))
        return torch.tensor(np.array(rows), dtype=torch.float32)

    def write_arrays(tokens, positions, slots, hidden, rope=None):
        assert rope is None                         # text only: every section takes the token position
        tokens = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
        drafter._written = (tokens, np.asarray(positions).tolist(), np.asarray(slots).tolist(), hidden[:, 0].tolist())
        return len(tokens), len(tokens), None

    def forward_written(cm, chunks, tree_rows, n, padded, mode, device_rows=None):
        tokens, positions, slots, hid = drafter._written
        packed = DeviceTreeRows.pack(tree_rows, "cpu", words=words)
        drafter.levels.append({"tokens": tokens, "positions": positions, "slots": slots, "hidden": hid,
                               "chunks": [(c[0], len(c[1]), c[3]) for c in chunks],
                               "meta": packed.meta.tolist(), "bits": packed.bits.tolist()})
        out = [(h * 1000003 + t) % (1 << 22) for h, t in zip(hid, tokens)]
        return torch.tensor(out, dtype=torch.float32)[:, None]

    drafter._top_rows, drafter._write_arrays, drafter._forward_written = top_rows, write_arrays, forward_written
    drafter._slots = lambda r, positions: np.asarray(positions, dtype=np.int64) + 10000 * (r + 1)
    drafter.text_offsets = lambda reqs: None        # no M-RoPE offsets (text only)
    drafter._device_slots = lambda r, positions: positions + 10000 * (r + 1)
    return drafter


def _grow(drafter, beam, reqs, roots, per_request=None, budget=None, device_roots=False):
    drafter.levels = []
    step = DraftStep(req_ids=[], contexts=[], per_request=per_request, budget=budget)
    hidden = torch.tensor([[float(7 + 13 * r)] for r in reqs])
    if beam and device_roots:   # roots not on the host: the level plan from a device tensor and a bound
        trees = DeviceBeam(drafter).grow(step, None, reqs, torch.tensor(roots), hidden, root_bound=max(roots))
    elif beam:
        trees = DeviceBeam(drafter).grow(step, None, reqs, roots, hidden)
    else:
        trees = drafter._grow_on_host(step, None, reqs, roots, hidden)
    return trees, drafter.levels


def _case(seed):
    rng = random.Random(seed)
    k, depth = rng.choice([(1, 5), (2, 4), (3, 4), (4, 3), (4, 8), (2, 8)])
    reqs = sorted(rng.sample(range(12), rng.randint(1, 5)))
    roots = [rng.randint(1, 300) for _ in reqs]
    synthetic = SyntheticAcceptance(rates=(0.9, 0.8, 0.7), sibling_rates=(0.35, 0.2), seed=0) if seed % 3 == 0 else None
    return k, depth, reqs, roots, synthetic


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("device_roots", [False, True])
def test_device_levels_match_host_levels_without_pruning(seed, device_roots):
    k, depth, reqs, roots, synthetic = _case(seed)
    drafter = _stand_in(k, depth, synthetic)
    host_trees, host_levels = _grow(drafter, False, reqs, roots)
    beam_trees, beam_levels = _grow(drafter, True, reqs, roots, device_roots=device_roots)
    assert len(host_levels) == depth - 1
    assert beam_levels == host_levels        # queries, positions, slots, hidden rows, lengths, tree rows
    for h, b in zip(host_trees, beam_trees):
        assert (b.tokens, b.parents) == (h.tokens, h.parents)
        assert np.allclose(b.scores, h.scores, rtol=1e-6)
        assert len(h) == k + (depth - 1) * k * k


@pytest.mark.parametrize("seed", range(16))
@pytest.mark.parametrize("per_request,budget", [(32, 128), (6, 9), (12, 16), (3, 4), (32, 0), (100, 1000)])
@pytest.mark.parametrize("device_roots", [False, True])
def test_device_levels_select_what_pruned_host_levels_select(seed, per_request, budget, device_roots):
    k, depth, reqs, roots, synthetic = _case(seed)
    drafter = _stand_in(k, depth, synthetic)
    host_trees, host_levels = _grow(drafter, False, reqs, roots, per_request, budget)
    beam_trees, beam_levels = _grow(drafter, True, reqs, roots, per_request, budget, device_roots)
    want = select_step(host_trees, per_request, budget)
    assert [(t.tokens, t.parents) for t in beam_trees] == [(t.tokens, t.parents) for t in want]
    assert len(beam_levels) <= depth - 1
    if budget == 0:
        assert beam_levels == [] and all(len(t) == 0 for t in beam_trees)


@pytest.mark.parametrize("seed", range(20))
def test_selection_alive_matches_host_floors(seed):
    rng = np.random.default_rng(seed)
    g, n, k = int(rng.integers(1, 6)), int(rng.integers(1, 40)), int(rng.integers(1, 5))
    scores = rng.choice(PROBS, size=(g, n)) if seed % 2 else rng.random((g, n))
    front = rng.choice(PROBS, size=(g, k)) if seed % 2 else rng.random((g, k))
    per_request, budget = int(rng.integers(1, 50)), int(rng.integers(1, 100))
    floors = selection_floors([list(s) for s in scores], per_request, budget)
    want = any(f > fl for row, fl in zip(front, floors) for f in row)
    got = selection_alive(torch.tensor(scores, dtype=torch.float64), torch.tensor(front, dtype=torch.float64),
                          per_request, budget)
    assert bool(got) == want
    # As a beam graph computes it: the budget as a device scalar, and padding requests (any scores, even NaN,
    # and frontier nodes far above every floor) that must not count.
    pad = int(rng.integers(0, 4))
    padded = np.concatenate([scores, rng.random((pad, n)) * 10])
    padded_front = np.concatenate([front, np.full((pad, k), 100.0)])
    if pad:
        padded[-1, 0] = np.nan
    real = torch.arange(g + pad) < g
    got = selection_alive(torch.tensor(padded, dtype=torch.float64), torch.tensor(padded_front, dtype=torch.float64),
                          per_request, torch.tensor(budget), real)
    assert bool(got) == want


@pytest.mark.parametrize("cols,words", [(1, 1), (5, 1), (31, 1), (32, 1), (33, 2), (64, 3)])
def test_pack_bits_is_the_host_layout(cols, words):
    from vllm_bole.step.forest import TreeRows

    mask = torch.rand(7, cols) < 0.5
    host = DeviceTreeRows.pack([TreeRows(req_index=0, row_start=0, region_mask=mask)], "cpu", words=words)
    assert torch.equal(pack_bits(mask, host.bits.shape[1]), host.bits)


def random_candidates(rng, g: int, k: int, levels: int, ties: bool):
    """A beam's candidates for ``g`` requests: ``levels`` levels of k children under each of k random nodes of the
    level above, scores from PROBS (many ties) or uniform. Returns (n, depths, parents, scores, tokens)."""
    n = k + levels * k * k
    depths = np.concatenate([np.ones(k, dtype=np.int64)] + [np.full(k * k, d + 2) for d in range(levels)])
    parents = np.full((g, n), -1, dtype=np.int64)
    scores = np.zeros((g, n))
    probs = (lambda size: rng.choice(PROBS, size=size)) if ties else (lambda size: rng.random(size))
    scores[:, :k] = probs((g, k))
    for d in range(levels):
        lo = 0 if d == 0 else k + (d - 1) * k * k
        hi = k if d == 0 else lo + k * k
        base = k + d * k * k
        for r in range(g):
            front = rng.choice(np.arange(lo, hi), size=k, replace=False)
            parents[r, base:base + k * k] = np.repeat(front, k)
            scores[r, base:base + k * k] = scores[r, np.repeat(front, k)] * probs(k * k)
    tokens = rng.integers(0, 1 << 20, size=(g, n))
    return n, depths, parents, scores, tokens


@pytest.mark.parametrize("seed", range(30))
def test_device_selection_is_select_step(seed):
    """The beam's selection on the device keeps select_step's nodes (ties included), re-indexed the same way."""
    rng = np.random.default_rng(seed)
    g, k, levels = int(rng.integers(1, 7)), int(rng.integers(1, 5)), int(rng.integers(0, 4))
    n, depths, parents, scores, tokens = random_candidates(rng, g, k, levels, ties=seed % 2 == 1)
    per_request = [None, int(rng.integers(0, 3 * n))][seed % 3 != 0]
    budget = [None, int(rng.integers(0, 2 * n * g))][seed % 4 != 0]
    chosen = selected_mask(torch.tensor(scores), torch.tensor(depths), per_request, budget)
    r, i = (t.numpy() for t in chosen.nonzero(as_tuple=True))
    host = np.stack([r, i, tokens[r, i], parents[r, i], scores[r, i]]).astype(np.float64)
    got = trees_of_selection(host, g, n)
    trees = [DraftTree(tokens[j].tolist(), parents[j].tolist(), scores[j].tolist()) for j in range(g)]
    want = select_step(trees, 10**9 if per_request is None else per_request, 10**9 if budget is None else budget)
    assert [(t.tokens, t.parents, t.scores) for t in got] == [(t.tokens, t.parents, t.scores) for t in want]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("graphs", [True, False])
def test_device_rows_branch_matches_host_rows_branch(seed, graphs):
    """The beam's GPU branch (device bits; through the drafter level graphs, or eagerly with device rows), run
    on CPU with a stand-in capture, grows the trees of its CPU branch (host masks) from the same queries."""
    from vllm.config import CUDAGraphMode

    from vllm_bole.spec_decode.draft_graphs import DraftGraphs

    k, depth, reqs, roots, synthetic = _case(seed)
    drafter = _stand_in(k, depth, synthetic)
    want, want_levels = _grow(drafter, True, reqs, roots, 32, 64)

    forward_written = drafter._forward_written
    device_rows = []

    def eager(cm, chunks, tree_rows, n, padded, mode, device_rows_=None, **kw):
        rows = kw.get("device_rows", device_rows_)
        assert tree_rows == [] and rows is not None
        device_rows.append((rows.meta.tolist(), rows.bits.tolist()))
        return forward_written(cm, chunks, [], n, padded, mode)

    drafter._forward_written = eager
    drafter.graphs = None
    if graphs:
        drafter.runner = SimpleNamespace(max_num_reqs=16, device=torch.device("cpu"), max_model_len=4096)
        drafter._metadata = lambda *args: None
        level_graphs = DraftGraphs(drafter)

        def capture(key, per_layer, tree_rows, padded):
            out = (torch.zeros(padded, 1), torch.zeros(padded, 2 * k))

            def replay():   # what the captured level computes, from what the drafter wrote
                tokens, _, _, hid = drafter._written
                hidden = forward_written(None, [], [], len(tokens), len(tokens), None)
                out[0][:len(tokens)] = hidden
                out[1][:len(tokens)] = drafter._top_rows(hidden)
                device_rows.append((level_graphs.meta[:len(reqs)].tolist(),
                                    level_graphs.bits[:len(tokens)].tolist()))
            entry = (SimpleNamespace(replay=replay), out)
            level_graphs.graphs[key] = entry
            return entry

        level_graphs._capture = capture
        drafter.graphs = level_graphs
        drafter._write_arrays = (lambda write: lambda *a: (*write(*a)[:2], CUDAGraphMode.PIECEWISE))(
            drafter._write_arrays)
    beam = DeviceBeam(drafter)
    beam.graphs = None   # the drafter's level graphs or the eager route (whole-level graphs: test_beam_graphs.py)
    beam.host_rows = lambda hidden: False
    drafter.levels = []
    step = DraftStep(req_ids=[], contexts=[], per_request=32, budget=64)
    cm = SimpleNamespace(block_table_tensor=torch.arange(16 * 8, dtype=torch.int32).view(16, 8))
    got = beam.grow(step, cm, reqs, roots, torch.tensor([[float(7 + 13 * r)] for r in reqs]))
    assert [(t.tokens, t.parents) for t in got] == [(t.tokens, t.parents) for t in want]
    assert len(device_rows) == len(want_levels) and (not graphs or drafter.graphs.replays == len(want_levels))
    for (meta, bits), level in zip(device_rows, want_levels):   # the bits the host rows pack into
        assert meta == level["meta"] and bits == [b[:len(bits[0])] for b in level["bits"]]
