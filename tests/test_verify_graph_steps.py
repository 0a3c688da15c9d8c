"""How a verification step runs from Bole's graphs (worker/verify_graphs.py), on CPU with a stand-in capture:
the key, the promotion of plain decodes, the forest buffer the graph reads, the bounds the layers see, and what
the commit gets back after a replay."""

import os
from types import SimpleNamespace

import pytest
import torch
from vllm.config import CUDAGraphMode

from vllm_bole import envs
from vllm_bole.attention import graph_mode
from vllm_bole.step.forest import StepForest
from vllm_bole.worker import verify_graphs


class _Scratch:
    def __init__(self):
        self.layers, self.slots, self.checkpoints, self.resets = [], [], [], 0

    def reset(self):
        self.resets += 1
        self.layers.clear()
        self.slots.clear()
        self.checkpoints.clear()


def _setup(monkeypatch, mode=CUDAGraphMode.PIECEWISE, mamba_cache_mode="none", gdn_spec=None):
    table = torch.arange(8 * 3, dtype=torch.int32).view(8, 3)
    runner = SimpleNamespace(
        cache_config=SimpleNamespace(mamba_cache_mode=mamba_cache_mode),
        max_num_tokens=64, max_num_reqs=8, device=torch.device("cpu"), max_model_len=512,
        bole_config=SimpleNamespace(max_nodes_per_request=6),
        query_start_loc=SimpleNamespace(gpu=torch.zeros(9, dtype=torch.int32)),
        seq_lens=torch.zeros(8, dtype=torch.int32),
        input_batch=SimpleNamespace(block_table=[SimpleNamespace(block_table=SimpleNamespace(gpu=table),
                                                                 slot_mapping=SimpleNamespace(gpu=torch.arange(64)))]),
        kv_cache_config=SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=["gdn.0", "attn.1"],
                                                                         kv_cache_spec=gdn_spec)]))
    context = SimpleNamespace(cudagraph_runtime_mode=mode, attn_metadata=None)
    monkeypatch.setattr(verify_graphs, "get_forward_context", lambda: context)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    seen = []   # what each run of the layers saw: (graph bounds, parents, cu_seqlens, mode)

    def capture(call, pool):
        output = call()
        return SimpleNamespace(replay=lambda: seen.append(("replay",) + _view(current[0]))), output

    monkeypatch.setattr(verify_graphs, "capture", capture)
    current = [None]
    return verify_graphs.VerifyGraphs(runner), runner, context, seen, current


def _view(forest):
    g = forest.graph
    return ((g.num_tokens, g.num_reqs, g.max_nodes, g.long_prefix), forest.parent.tolist(),
            forest.cu_seqlens.tolist())


def _forest(graphs, parents, plain, starts, tree_reqs, max_seq_len=40):
    parent, cu = graphs.forest_tensors([p for t in parents for p in t], [0] + torch.tensor(
        [len(t) for t in parents]).cumsum(0).tolist())
    return StepForest(req_ids=[f"r{r}" for r in tree_reqs], tree_req_indices=tree_reqs, parent=parent,
                      cu_seqlens=cu, tokens=[[-1] + [5] * (len(t) - 1) for t in parents], tree_parents=parents,
                      max_nodes=max(len(t) for t in parents), query_starts=starts, tree_only=True,
                      max_seq_len=max_seq_len, plain_decodes=plain, attention_rows=None)


def test_step_captures_then_replays_with_the_graphs_bounds(monkeypatch):
    graphs, runner, context, seen, current = _setup(monkeypatch)
    scratch = _Scratch()
    ids = torch.zeros(8, dtype=torch.long)   # vLLM's persistent input buffer

    def step(forest, rows, ids=ids):
        current[0] = forest

        def call():   # the layers: they read the forest and bounds, and register in the GDN scratch
            if forest.graph is None:   # vLLM's own path
                seen.append(("vllm",))
                return "vllm"
            seen.append((context.cudagraph_runtime_mode,) + _view(forest))
            forest.gdn_scratch = scratch
            scratch.layers.append("gdn.0")
            scratch.slots.append(forest.graph.state_slots("gdn.0"))
            return torch.zeros(rows, 4)

        return graphs.forward(forest, call, (ids[:rows], None, None, None, ()))

    # Request 1 has a 3-node tree; requests 0 and 2 are plain decodes: five rows padded to 8, three requests to 4.
    forest = _forest(graphs, [[-1, 0, 0]], [(0, "a", 0), (2, "c", 4)], [1], [1])
    out = step(forest, 8)
    assert out.shape == (8, 4)
    bounds, parents, cu = (8, 4, 6 + 1, False), [-1, -1, 0, 0, -1, 0, 0, 0], [0, 1, 4, 5, 5, 5]
    assert seen == [(CUDAGraphMode.NONE, bounds, parents, cu[:5])] * 2 + [("replay", bounds, parents, cu[:5])]
    assert context.cudagraph_runtime_mode == CUDAGraphMode.PIECEWISE
    # After the replay the commit sees the step's own three trees, the capture's GDN layers and slots.
    assert forest.tree_req_indices == [0, 1, 2] and forest.cu_seqlens.tolist() == [0, 1, 4, 5]
    assert forest.gdn_scratch is scratch and scratch.layers == ["gdn.0"]
    assert scratch.slots[0].tolist() == [0, 3, 6, 9]     # block-table column 0 of the bucket's requests
    assert forest.has_tree_rows and forest.attention_rows is None   # host rows never built in graph mode

    # Another step of the same key replays without a capture; a long prefix is another key.
    seen.clear()
    step(_forest(graphs, [[-1], [-1, 0]], [(2, "c", 3)], [0, 1], [0, 1]), 8)
    assert [s[0] for s in seen] == ["replay"] and len(graphs.graphs) == 1 and graphs.replays == 2
    seen.clear()
    step(_forest(graphs, [[-1], [-1, 0]], [], [0, 1], [0, 1], max_seq_len=4000), 8)
    assert [s[0] for s in seen] == [CUDAGraphMode.NONE, CUDAGraphMode.NONE, "replay"] and len(graphs.graphs) == 2
    # vLLM moved its input buffer: the graph would read stale memory, so the step runs as vLLM does.
    seen.clear()
    moved = torch.zeros(8, dtype=torch.long)
    assert step(_forest(graphs, [[-1], [-1, 0]], [(2, "c", 3)], [0, 1], [0, 1]), 8, ids=moved) == "vllm"
    assert seen == [("vllm",)]


def test_a_step_of_fewer_requests_or_smaller_trees_replays_a_wider_graph(monkeypatch):
    """A step of two requests replays a held graph of a four-request bucket at its token count: the layers see
    four trees (the last two empty) and the bucket's state slots, the commit the step's own two; a step whose
    trees fit the bound 8 replays a held graph of bound 16 (the layers and the walk see 16)."""
    graphs, runner, context, seen, current = _setup(monkeypatch)
    runner.bole_config.max_nodes_per_request = 32
    scratch = _Scratch()
    ids = torch.zeros(16, dtype=torch.long)

    def step(parents):
        forest = _forest(graphs, parents, [], [0] + torch.tensor([len(t) for t in parents[:-1]]).cumsum(0).tolist(),
                         list(range(len(parents))))
        current[0] = forest

        def call():
            seen.append((context.cudagraph_runtime_mode,) + _view(forest))
            forest.gdn_scratch = scratch
            scratch.layers.append("gdn.0")
            scratch.slots.append(forest.graph.state_slots("gdn.0"))
            return torch.zeros(forest.graph.num_tokens, 4)

        out = graphs.forward(forest, call, (ids[:16], None, None, None, ()))
        return forest, out

    step([[-1, 0, 0], [-1, 0], [-1], [-1, 0, 1]])               # 9 rows of 4 requests: key (16, 4, False, 8)
    assert sorted(graphs.graphs) == [(16, 4, False, 8)]
    seen.clear()
    forest, out = step([[-1, 0, 0, 1], [-1, 0, 1]])               # 2 requests: bucket 2, replays the bucket of 4
    assert sorted(graphs.graphs) == [(16, 4, False, 8)] and graphs.stand_ins.replays == 1 and out.shape == (16, 4)
    assert seen == [("replay", (16, 4, 8, False), [-1, 0, 0, 1, -1, 0, 1] + seen[0][2][7:], [0, 4, 7, 7, 7])]
    assert forest.cu_seqlens.tolist() == [0, 4, 7] and scratch.slots[-1].tolist() == [0, 3, 6, 9]
    # A bound of 16 held at 16 rows and 2 requests: a step of small trees of 2 requests replays it.
    step([[-1] + list(range(9)), [-1]])                           # a 10-node tree: key (16, 2, False, 16), captured
    assert (16, 2, False, 16) in graphs.graphs
    seen.clear()
    del graphs.graphs[(16, 4, False, 8)]
    forest, _ = step([[-1, 0], [-1]])
    assert seen[-1][:2] == ("replay", (16, 2, 16, False)) and forest.max_nodes == 16
    assert graphs.stand_ins.replays == 2


def test_steps_that_cannot_replay_run_as_vllm_does(monkeypatch):
    graphs, runner, context, seen, current = _setup(monkeypatch, mode=CUDAGraphMode.NONE)
    forest = _forest(graphs, [[-1, 0]], [(0, "a", 0)], [1], [1])
    calls = []
    out = graphs.forward(forest, lambda: calls.append(1) or "vllm", (torch.zeros(3), None, None, None, ()))
    assert out == "vllm" and calls == [1] and not graphs.graphs
    assert forest.plain_decodes == [(0, "a", 0)] and forest.graph is None     # not promoted
    context.cudagraph_runtime_mode = CUDAGraphMode.PIECEWISE
    forest.tree_only = False                                                   # a prefill beside the trees
    assert graphs.forward(forest, lambda: "vllm", (torch.zeros(3), None, None, None, ())) == "vllm"


def test_node_bound_is_the_smallest_tile_size_that_holds_the_largest_tree():
    bound = verify_graphs.node_bound
    assert [bound(n, 512, 33) for n in (0, 1, 5, 8, 9, 16, 17, 32, 33)] == [8, 8, 8, 8, 16, 16, 32, 32, 33]
    assert bound(5, 6, 33) == 6           # never above the step's padded rows
    assert bound(5, 64, 7) == 7           # a cap below the first bound: the cap (depth 3, topk 2)
    assert bound(8, 64, 8) == 8 and bound(9, 64, 17) == 16 and bound(17, 64, 17) == 17


def test_steps_of_small_trees_run_under_a_small_bound(monkeypatch):
    """The key carries the bound on the step's tree sizes: trees of 5 nodes (a batch's quota of 4) run under 8,
    not under the 33 nodes a request may carry (the kernels size their row tiles by it); a step of larger trees
    at the same token count is another key."""
    graphs, runner, context, seen, current = _setup(monkeypatch)
    runner.bole_config.max_nodes_per_request = 32

    def step(parents):
        forest = _forest(graphs, parents, [], [0] + [len(parents[0])] * (len(parents) > 1), list(range(len(parents))))
        current[0] = forest

        def call():
            seen.append(_view(forest)[0])
            forest.gdn_scratch = _Scratch()
            return torch.zeros(16, 4)

        graphs.forward(forest, call, (torch.zeros(16, dtype=torch.long), None, None, None, ()))
        return forest

    chain5 = [-1, 0, 1, 2, 3]
    forest = step([chain5, chain5])
    assert (16, 2, 8, False) in seen and forest.max_nodes == 8      # what the layers saw, and the walk's bound
    forest = step([list(range(-1, 12)), [-1, 0, 1]])      # 13 and 3 nodes: the same 16 rows
    assert (16, 2, 16, False) in seen and forest.max_nodes == 16
    assert sorted(graphs.graphs) == [(16, 2, False, 8), (16, 2, False, 16)]


def test_a_new_token_count_replays_a_held_larger_graph_until_it_recurs(monkeypatch):
    """A step whose key is not held replays the graph of the same requests, route and bound with the fewest
    more tokens (within the padding allowance): its output is cut to the step's rows and the extra rows' KV
    slots are -1; when the key comes back for the CAPTURE_AFTER-th time, its stand-ins' padding having cost
    CAPTURE_COST_STEPS by then (here one step, every row counted and nothing else: 0.5 per 16-row step under the
    24-row graph), it gets its own graph; a held graph that would cost more than MAX_PAD_COST (here 2) stands in
    for nothing."""
    graphs, runner, context, seen, current = _setup(monkeypatch)
    monkeypatch.setattr(graph_mode, "CAPTURE_AFTER", 3)
    for name, value in (("FLAT_ROWS", 0), ("FIXED_ROWS", 0), ("MAX_PAD_COST", 2.0), ("CAPTURE_COST_STEPS", 1.0)):
        monkeypatch.setattr(graph_mode, name, value)
    runner.bole_config.max_nodes_per_request = 32
    ids = torch.zeros(64, dtype=torch.long)
    slots = runner.input_batch.block_table[0].slot_mapping.gpu

    def step(rows, parents=([-1, 0, 0], [-1, 0])):
        forest = _forest(graphs, list(parents), [], [0, len(parents[0])], [0, 1])
        current[0] = forest

        def call():
            seen.append((context.cudagraph_runtime_mode,) + _view(forest))
            forest.gdn_scratch = _Scratch()
            return torch.arange(forest.graph.num_tokens)[:, None].float()

        return graphs.forward(forest, call, (ids[:rows], None, None, None, ()))

    assert graphs.capture_ms == 0.0
    assert step(24).shape == (24, 1) and sorted(graphs.graphs) == [(24, 2, False, 8)]
    spent = graphs.capture_ms
    assert spent > 0.0   # the capture's host time, which e2e.py reports per timed run
    for occurrence in (1, 2):   # 16 rows: the 24-row graph stands in, its rows 16..23 write no K/V
        seen.clear()
        slots.copy_(torch.arange(64))
        out = step(16)
        assert [s[0] for s in seen] == ["replay"] and seen[0][1][0] == 24
        assert out.tolist() == [[float(i)] for i in range(16)]
        assert slots[:16].tolist() == list(range(16)) and slots[16:24].tolist() == [-1] * 8
        assert slots[24:].tolist() == list(range(24, 64))
        assert sorted(graphs.graphs) == [(24, 2, False, 8)] and graphs.stand_ins.replays == occurrence
    seen.clear()
    assert graphs.capture_ms == spent   # stand-ins capture nothing
    step(16)   # the third time: captured
    assert graphs.capture_ms > spent
    assert [s[0] for s in seen][-1] == "replay" and seen[-1][1][0] == 16
    assert sorted(graphs.graphs) == [(16, 2, False, 8), (24, 2, False, 8)] and graphs.stand_ins.replays == 2
    # Another bound is captured at once; a step of 8 rows replays the fewest rows that hold it (16, not 24).
    step(16, parents=(list(range(-1, 11)), [-1]))
    assert (16, 2, False, 16) in graphs.graphs and graphs.stand_ins.replays == 2
    seen.clear()
    step(8)
    assert seen[-1][1][0] == 16 and graphs.stand_ins.replays == 3 and (8, 2, False, 8) not in graphs.graphs
    # A held graph past the allowance (16 rows: at most 48) stands in for nothing: captured at once.
    graphs.graphs = {(56, 2, False, 8): graphs.graphs[(24, 2, False, 8)]}
    graphs.stand_ins.misses.clear()
    seen.clear()
    step(16)
    assert sorted(graphs.graphs) == [(16, 2, False, 8), (56, 2, False, 8)] and graphs.stand_ins.replays == 3
    assert seen[-1] == ("replay", (16, 2, 8, False), seen[-1][2], [0, 3, 5])


def test_stand_in_keeps_requests_bound_and_route():
    """The held graph of the same request bucket, bound and route that costs least (fewest rows on a tie), within
    MAX_PAD_COST: any size up to 304 rows for a step of at most 128 (a forward that reads the weights once costs the
    same), about half again as many rows above (a fixed part of the forward worth 224 rows)."""
    held = [(32, 4, False, 8), (40, 4, False, 16), (40, 8, False, 8), (48, 4, True, 8), (64, 4, False, 8)]
    stand_in = graph_mode.stand_in
    assert stand_in((24, 4, False, 8), held, 100) == (32, 4, False, 8)
    assert stand_in((32, 4, False, 8), [(32, 4, False, 8), (16, 4, False, 8)], 100) is None   # larger keys only
    assert stand_in((40, 4, False, 8), held, 100) == (64, 4, False, 8)
    assert stand_in((128, 4, False, 8), [(256, 4, False, 8)], 100) == (256, 4, False, 8)
    assert stand_in((8, 4, False, 8), [(288, 4, False, 8)], 100) == (288, 4, False, 8)
    assert stand_in((8, 4, False, 8), [(320, 4, False, 8)], 100) is None          # 192 / 352 rows' worth more
    assert stand_in((8, 4, False, 8), held, 100) == (32, 4, False, 8)
    assert stand_in((24, 4, True, 8), held, 4000) == (48, 4, True, 8)  # a long prefix: that route's graphs only
    assert stand_in((24, 2, False, 8), held, 100) is None
    assert stand_in((200, 4, False, 8), [(416, 4, False, 8)], 100) is None   # 216 / 424: more than half a step
    assert stand_in((200, 4, False, 8), [(408, 4, False, 8), (416, 4, False, 8)], 100) == (408, 4, False, 8)


def test_wider_stand_ins_take_larger_buckets_and_bounds():
    """Verification graphs also stand in for up to twice the request bucket or node bound at as many tokens or
    more (extra requests empty, smaller trees under a wider bound): the least padding cost first (a wider bound
    costs kernel work, empty requests and rows below 128 do not), then the fewest tokens, the smaller bound, the
    smaller bucket; never a smaller bucket or bound, never more than twice, never the key itself."""
    held = [(32, 8, False, 8), (32, 4, False, 16), (40, 4, False, 8), (32, 16, False, 8), (32, 4, False, 32)]
    stand_in = graph_mode.stand_in
    assert stand_in((32, 4, False, 8), held, 100) == (40, 4, False, 8)               # same bucket and bound only
    assert stand_in((32, 4, False, 8), held, 100, wider=True) == (32, 8, False, 8)   # as many rows, the same bound
    assert stand_in((32, 4, False, 8), held[1:], 100, wider=True) == (40, 4, False, 8)   # more rows cost nothing here
    assert stand_in((32, 4, False, 8), [(32, 4, False, 16), (32, 4, False, 32)], 100, wider=True) == (32, 4, False, 16)
    assert stand_in((32, 4, False, 8), [(32, 16, False, 8), (32, 4, False, 32)], 100, wider=True) is None
    assert stand_in((32, 8, False, 16), [(40, 4, False, 16), (32, 8, False, 8)], 100, wider=True) is None
    assert stand_in((32, 4, False, 8), [(32, 4, False, 8)], 100, wider=True) is None   # itself
    assert stand_in((24, 2, False, 8), held, 100, wider=True) == (40, 4, False, 8)
    assert stand_in((24, 2, True, 8), [(32, 4, False, 8)], 4000, wider=True) is None   # the route still holds


def test_padding_cost_counts_rows_above_the_flat_region():
    cost = graph_mode.padding_cost
    assert (graph_mode.FLAT_ROWS, graph_mode.FIXED_ROWS) == (128, 224)

    def rows(a, b):
        return cost((a, 4, False, 8), (b, 4, False, 8))

    assert rows(8, 40) == 0.0 and rows(64, 128) == 0.0          # a forward of up to 128 rows costs the same
    assert rows(96, 192) == pytest.approx(64 / 352) and rows(192, 288) == pytest.approx(96 / 416)
    assert rows(160, 352) == 0.5 and rows(512, 768) == pytest.approx(256 / 736)
    assert cost((64, 4, False, 8), (64, 8, False, 8)) == 0.0    # empty requests
    assert cost((64, 4, False, 8), (64, 4, False, 16)) == graph_mode.WIDER_BOUND_COST == 0.05


def test_stand_ins_capture_once_their_padding_costs_a_capture(monkeypatch):
    """A key is captured at its CAPTURE_AFTER-th occurrence at the earliest, and only once its stand-ins' padding
    adds up to CAPTURE_COST_STEPS of its own steps: at once when nothing larger is held, never while a held graph
    pads it within the flat region, after 16 occurrences under a graph that costs half a step more, and never while
    the holder is full."""
    monkeypatch.setattr(graph_mode, "CAPTURE_AFTER", 3)
    assert graph_mode.CAPTURE_COST_STEPS == 8.0
    held = {(128, 4, False, 8): None, (352, 4, False, 8): None}
    stand_ins = graph_mode.StandIns()
    assert stand_ins.pick((384, 4, False, 8), held, 100, 384) is None             # nothing larger held
    for _ in range(100):                                                          # 64 rows under 128: free
        assert stand_ins.pick((64, 4, False, 8), held, 100, 384) == (128, 4, False, 8)
    picks = [stand_ins.pick((160, 4, False, 8), held, 100, 384) for _ in range(16)]
    assert picks[:15] == [(352, 4, False, 8)] * 15 and picks[15] is None   # 16 x 0.5 steps: the price of a capture
    assert stand_ins.replays == 115 and stand_ins.cost[(160, 4, False, 8)] == 8.0
    full = graph_mode.StandIns()
    assert all(full.pick((160, 4, False, 8), held, 100, 2) == (352, 4, False, 8) for _ in range(40))
    monkeypatch.setattr(graph_mode, "CAPTURE_AFTER", 1)   # stand-ins off, but for a full holder
    assert graph_mode.StandIns().pick((160, 4, False, 8), held, 100, 384) is None
    assert graph_mode.StandIns().pick((160, 4, False, 8), held, 100, 2) == (352, 4, False, 8)


def test_capture_after_one_captures_every_new_key_at_once(monkeypatch):
    """With VLLM_BOLE_CAPTURE_AFTER=1 the stand-ins are off: a step of fewer tokens gets its own graph even where
    a larger held one would fit (without the variable a key waits for its third occurrence)."""
    if "VLLM_BOLE_CAPTURE_AFTER" not in os.environ:
        assert graph_mode.CAPTURE_AFTER == 3
    monkeypatch.setattr(graph_mode, "CAPTURE_AFTER", 1)
    graphs, runner, context, seen, current = _setup(monkeypatch)
    runner.bole_config.max_nodes_per_request = 32
    for rows in (24, 16):
        forest = _forest(graphs, [[-1, 0, 0], [-1, 0]], [], [0, 3], [0, 1])
        current[0] = forest

        def call(forest=forest):
            forest.gdn_scratch = _Scratch()
            return torch.zeros(forest.graph.num_tokens, 1)

        out = graphs.forward(forest, call, (torch.zeros(64, dtype=torch.long)[:rows], None, None, None, ()))
        assert out.shape[0] == rows
    assert sorted(graphs.graphs) == [(16, 2, False, 8), (24, 2, False, 8)] and graphs.stand_ins.replays == 0


@pytest.mark.parametrize("value", ["0", "-2", "three", ""])
def test_a_bad_capture_after_is_a_one_line_error(monkeypatch, value):
    monkeypatch.setenv("VLLM_BOLE_CAPTURE_AFTER", value)
    with pytest.raises(ValueError, match="^VLLM_BOLE_CAPTURE_AFTER must be a positive integer") as e:
        envs.VLLM_BOLE_CAPTURE_AFTER
    assert "\n" not in str(e.value)
    monkeypatch.setenv("VLLM_BOLE_CAPTURE_AFTER", "5")
    assert envs.VLLM_BOLE_CAPTURE_AFTER == 5
    monkeypatch.delenv("VLLM_BOLE_CAPTURE_AFTER")
    assert envs.VLLM_BOLE_CAPTURE_AFTER == 3


def test_with_prefix_caching_a_graph_reads_running_blocks_and_the_step_gets_its_checkpoints(monkeypatch):
    """Prefix caching (vLLM's "align" mode): a request's running GDN state lives in the block of its last scheduled
    token, so the graph reads each request's state slot from the persistent block table at the column of its
    ``seq_len`` (vLLM's pick, ``mamba_get_block_table_tensor``); and the commit after the replay gets the step's block
    checkpoints over the forest's requests, the plain decodes the graph runs as one-node trees having none."""
    from vllm.v1.attention.backends.utils import mamba_get_block_table_tensor
    from vllm.v1.kv_cache_interface import MambaSpec

    from vllm_bole.attention.gdn_metadata import BlockCheckpoints

    spec = MambaSpec(block_size=4, shapes=((1,),), dtypes=(torch.float32,), mamba_cache_mode="align")
    graphs, runner, context, seen, current = _setup(monkeypatch, mamba_cache_mode="align", gdn_spec=spec)
    layer, scratch, ids = SimpleNamespace(prefix="gdn.0"), _Scratch(), torch.zeros(8, dtype=torch.long)

    def step(forest, seq_lens, checkpoints):
        runner.seq_lens.zero_()
        runner.seq_lens[:len(seq_lens)] = torch.tensor(seq_lens)
        context.attn_metadata = {"gdn.0": SimpleNamespace(bole_checkpoints=checkpoints), "attn.1": SimpleNamespace()}
        current[0] = forest

        def call():
            forest.gdn_scratch = scratch
            scratch.layers.append(layer)
            scratch.slots.append(forest.graph.state_slots("gdn.0"))
            return torch.zeros(8, 4)

        graphs.forward(forest, call, (ids, None, None, None, ()))

    # Request 1's 3-node tree after 7 computed tokens (seq_len 10: block 2), plain decodes 0 and 2 (blocks 1 and 0),
    # padded request 3 (seq_len 0: column 0); request 1 reaches the boundary at 8 after one path token, into block 4.
    forest = _forest(graphs, [[-1, 0, 0]], [(0, "a", 0), (2, "c", 4)], [1], [1])
    step(forest, [6, 10, 1], BlockCheckpoints(path_lengths=[1], slots=torch.tensor([4], dtype=torch.int32),
                                              req_indices=[1]))
    table = runner.input_batch.block_table[0].block_table.gpu
    vllm_slots = mamba_get_block_table_tensor(table[:4], runner.seq_lens[:4], spec, "align")[:, 0]
    assert scratch.slots[0].tolist() == vllm_slots.tolist() == [1, 5, 6, 9]
    assert forest.tree_req_indices == [0, 1, 2] and scratch.layers == [layer]
    (over,) = scratch.checkpoints
    assert over.path_lengths == [0, 1, 0] and over.slots.tolist() == [0, 4, 0]

    # The replay of the same key gets that step's checkpoints; without them (no boundary in reach), none.
    step(_forest(graphs, [[-1], [-1, 0]], [(2, "c", 3)], [0, 1], [0, 1]), [5, 9, 2], BlockCheckpoints(
        path_lengths=[2, 0], slots=torch.tensor([3, 0], dtype=torch.int32), req_indices=[0, 1]))
    assert seen[-1][0] == "replay" and scratch.checkpoints[0].path_lengths == [2, 0, 0]
    assert scratch.checkpoints[0].slots.tolist() == [3, 0, 0]
    step(_forest(graphs, [[-1], [-1, 0]], [(2, "c", 3)], [0, 1], [0, 1]), [5, 9, 2], None)
    assert seen[-1][0] == "replay" and scratch.checkpoints == [None]
