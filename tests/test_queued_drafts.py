"""Per-request quotas (``selection: "per_request"``): the device selection keeps each request's quota of its best
nodes (what ``select_quotas`` keeps on the host), and the queued tensors the next step reads hold exactly the trees
the host walks: tokens, re-indexed parents and depths."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from test_device_beam import _case, _grow, _stand_in, random_candidates
from vllm_bole.kernels.tree_select.reference import quota_mask, quota_select
from vllm_bole.spec_decode.device_beam import DeviceBeam, trees_of_selection
from vllm_bole.spec_decode.drafter import DraftStep
from vllm_bole.spec_decode.queued_drafts import PLACEHOLDER, QueuedDrafts, quotas_of, select_quotas
from vllm_bole.spec_decode.tree import DraftTree


def _assert_queued_is(queued: QueuedDrafts, trees: list[DraftTree]) -> None:
    assert queued.counts == [len(t) for t in trees]
    for g, tree in enumerate(trees):
        n = len(tree)
        assert queued.tokens[g, :n].tolist() == tree.tokens
        assert queued.parents[g, :n].tolist() == tree.parents
        assert queued.depths[g, :n].tolist() == tree.depths()


@pytest.mark.parametrize("seed", range(30))
def test_quota_selection_is_select_quotas(seed):
    rng = np.random.default_rng(seed)
    g, k, levels = int(rng.integers(1, 7)), int(rng.integers(1, 5)), int(rng.integers(0, 4))
    n, depths, parents, scores, tokens = random_candidates(rng, g, k, levels, ties=seed % 2 == 1)
    counts = [int(c) for c in rng.integers(0, n + 1, size=g)]
    chosen = quota_mask(torch.tensor(scores), torch.tensor(depths), torch.tensor(counts))
    assert chosen.sum(dim=1).tolist() == counts
    r, i = (t.numpy() for t in chosen.nonzero(as_tuple=True))
    host = np.stack([r, i, tokens[r, i], parents[r, i], scores[r, i]]).astype(np.float64)
    got = trees_of_selection(host, g, n)
    trees = [DraftTree(tokens[j].tolist(), parents[j].tolist(), scores[j].tolist()) for j in range(g)]
    want = select_quotas(trees, counts)
    assert [(t.tokens, t.parents, t.scores) for t in got] == [(t.tokens, t.parents, t.scores) for t in want]
    again, tok, par, dep = quota_select(torch.tensor(scores), torch.tensor(depths),
                                        torch.tensor(tokens, dtype=torch.float64),
                                        torch.tensor(parents, dtype=torch.float64), torch.tensor(counts),
                                        max(max(counts), 1))
    assert torch.equal(again, chosen.double())
    _assert_queued_is(SimpleNamespace(counts=counts, tokens=tok, parents=par, depths=dep), want)


@pytest.mark.parametrize("seed", range(16))
def test_triton_quota_selection_is_the_torch_one(seed):
    """The one-launch selection (kernels/tree_select, the interpreter without a GPU) keeps the nodes the torch
    pair keeps (chosen mask) and queues the same trees, on random candidates with and without score ties, strided
    candidate rows (the beam's buffers are wider than a step's candidates), zero and full quotas, up to 256
    candidates."""
    from triton_modes import DEV, import_kernel_modules, interpreter

    (mod,) = import_kernel_modules("vllm_bole.kernels.tree_select.triton_select")
    rng = np.random.default_rng(500 + seed)
    g, k = int(rng.integers(1, 9)), int(rng.integers(1, 5))
    levels = int(rng.integers(0, 256 // (k * k) if seed % 4 == 0 else 4))
    n, depths, parents, scores, tokens = random_candidates(rng, g, k, levels, ties=seed % 2 == 1)
    n = min(n, mod.MAX_CANDIDATES)
    counts = [int(c) for c in rng.integers(0, n + 1, size=g)]
    counts[0] = n if seed % 3 == 0 else counts[0]
    # Candidates as columns :n of wider rows, as BeamState holds them.
    wide = [np.concatenate([a[:, :n], np.full((g, 7), -5.0)], axis=1) for a in (scores, tokens, parents)]
    sc, tok, par = (torch.tensor(a, dtype=torch.float64, device=DEV)[:, :n] for a in wide)
    dep = torch.tensor(depths[:n], device=DEV)
    width = max(max(counts), 1)
    with interpreter():
        chosen, q_tok, q_par, q_dep = mod.quota_select(sc, dep, tok, par, torch.tensor(counts, device=DEV), width)
    want_chosen, w_tok, w_par, w_dep = quota_select(sc.cpu(), dep.cpu(), tok.cpu(), par.cpu(), torch.tensor(counts),
                                                    width)
    assert torch.equal(chosen.cpu(), want_chosen)
    for j, c in enumerate(counts):
        for got, ref in ((q_tok, w_tok), (q_par, w_par), (q_dep, w_dep)):
            assert got[j, :c].cpu().tolist() == ref[j, :c].tolist(), (j, c)


@pytest.mark.parametrize("seed", range(12))
def test_beam_with_quotas_queues_its_trees(seed):
    k, depth, reqs, roots, synthetic = _case(seed)
    drafter = _stand_in(k, depth, synthetic)
    host_trees, _ = _grow(drafter, False, reqs, roots)     # every candidate, no pruning
    rng = np.random.default_rng(seed)
    quotas = [0] * 12
    for r in reqs:
        quotas[r] = int(rng.integers(1, 3 * k + 2))
    beam = DeviceBeam(drafter)
    hidden = torch.tensor([[float(7 + 13 * r)] for r in reqs])
    levels_seen = []
    for _ in range(3):   # later steps run as many levels as the last trees reached (plus one)
        drafter.levels = []
        step = DraftStep(req_ids=[f"r{j}" for j in range(12)], contexts=[], per_request=3 * k + 1, budget=None,
                         quotas=quotas)
        trees = beam.grow(step, None, reqs, roots, hidden)
        levels_seen.append(len(drafter.levels))
        _assert_queued_is(step.queued, trees)
        assert step.queued.req_ids == [f"r{r}" for r in reqs]
        assert [len(t) for t in trees] == [min(quotas[r], len(h)) for r, h in zip(reqs, host_trees)]
        deepest = max((max(t.depths(), default=0) for t in trees), default=0)
        assert deepest <= levels_seen[-1] + 1
    # The first step runs every level its quotas allow; its trees are what the host keeps of all candidates.
    bound = max(min(depth, max(quotas)) - 1, 0)
    assert levels_seen[0] == bound
    want = select_quotas(host_trees, [quotas[r] for r in reqs])
    beam_first = DeviceBeam(drafter).grow(DraftStep(req_ids=[f"r{j}" for j in range(12)], contexts=[],
                                                    per_request=3 * k + 1, quotas=quotas), None, reqs, roots, hidden)
    assert [(t.tokens, t.parents) for t in beam_first] == [(t.tokens, t.parents) for t in want]
    assert all(lv <= bound for lv in levels_seen)


def test_quotas_split_the_budget_evenly():
    assert quotas_of([True, False, True, True], 10, 8) == [3, 0, 3, 2]
    assert quotas_of([True, True], 3, 100) == [3, 3]
    assert quotas_of([True, True], 5, None) == [5, 5]
    assert quotas_of([False, False], 5, 7) == [0, 0]
    assert quotas_of([True, True, True], 4, 0) == [0, 0, 0]
    assert quotas_of([True] * 5, 32, 3) == [1, 1, 1, 0, 0]


def test_host_trees_as_queued_drafts():
    trees = [DraftTree([5, 6, 7], [-1, 0, 0], [0.5, 0.2, 0.1]), DraftTree(), DraftTree([9], [-1], [0.9])]
    queued = QueuedDrafts.of_trees(["a", "b", "c"], trees, "cpu")
    _assert_queued_is(queued, trees)
    assert queued.placeholder_ids(["c", "a", "x"]) == [[PLACEHOLDER], [PLACEHOLDER] * 3, []]
    assert queued.count("b") == 0 and queued.count("zz") == 0


def test_padded_trees_fill_their_quota_under_the_root():
    """Async scheduling: a host drafter's tree smaller than its quota gets root children of a fixed token (score 0,
    after the real nodes), so every placeholder vLLM scheduled has a node; its nodes and their order are kept."""
    tree = DraftTree([5, 6, 7], [-1, 0, 1], [0.9, 0.8, 0.7])
    padded = tree.padded(6)
    assert padded.tokens == [5, 6, 7, 0, 0, 0] and padded.parents == [-1, 0, 1, -1, -1, -1]
    assert padded.scores[3:] == [0.0] * 3 and padded.depths() == [1, 2, 3, 1, 1, 1]
    assert padded.truncated(3) == tree and tree.padded(2) == tree and DraftTree().padded(2).depths() == [1, 1]


@pytest.mark.parametrize("budget,batch,per_request,expect", [
    (36, 6, 6, 6), (36, 7, 6, 5), (12, 24, 6, 0), (512, 1, 6, 6), (100, 3, 64, 33)])
def test_async_quota_is_the_budget_split_evenly(budget, batch, per_request, expect):
    from vllm_bole.config import BoleConfig
    from vllm_bole.worker.scheduler import async_budget, async_quotas

    assert async_budget(BoleConfig(budget=budget), batch, context_len=100) == (budget, False)
    assert async_quotas(budget, per_request, batch)[0] == expect
    assert async_quotas(budget, per_request, 0) == (0, frozenset())


@pytest.mark.parametrize("budget,batch,per_request,drafting,expect_k,expect_more", [
    (96, 64, 8, 64, 1, 32),    # the remainder one node each to the first 32 drafting requests
    (100, 3, 64, 3, 33, 1),
    (36, 7, 6, 7, 5, 1),
    (36, 6, 6, 6, 6, 0),       # even split
    (40, 6, 6, 6, 6, 0),       # each at num_spec_tokens already
    (12, 24, 6, 24, 0, 0),     # below the batch size: every request decodes plainly
    (96, 64, 8, 10, 1, 10),    # 54 requests without placeholders (prefill chunks, structured outputs): at most +1
])
def test_async_quotas_give_the_remainder_to_the_first_drafting_requests(budget, batch, per_request, drafting,
                                                                         expect_k, expect_more):
    from vllm_bole.worker.scheduler import Placeholders, async_quotas

    ids = [f"r{i}" for i in range(drafting)]
    k, one_more = async_quotas(budget, per_request, batch, ids)
    assert (k, one_more) == (expect_k, frozenset(ids[:expect_more]))
    placeholders = Placeholders(k, one_more)
    sizes = [placeholders.quota(r) for r in ids]
    assert sum(sizes) <= budget and all(k <= q <= min(k + 1, per_request) for q in sizes)
    assert Placeholders.of(SimpleNamespace(num_spec_tokens_to_schedule=3)) == Placeholders(3)


@pytest.mark.parametrize("seed", range(6))
def test_filled_quotas_grow_enough_levels_after_shallow_trees(seed):
    """Async scheduling (``fill_quotas``): vLLM placed each quota's placeholders before the drafter ran, so every
    tree holds its whole quota even after steps whose trees stayed shallow (the level hint would grow fewer
    levels, and the tree fewer candidates than its quota)."""
    k, depth, reqs, roots, synthetic = _case(seed)
    depth = max(depth, 4)
    drafter = _stand_in(k, depth, synthetic)
    beam = DeviceBeam(drafter)
    hidden = torch.tensor([[float(7 + 13 * r)] for r in reqs])
    quota = min(depth * k, k + 2 * k * k)   # needs two expansion levels when k > 1
    quotas = [quota if r in reqs else 0 for r in range(12)]
    beam._level_hint[quota] = 1   # the last trees of this quota reached one level only
    step = DraftStep(req_ids=[f"r{j}" for j in range(12)], contexts=[], per_request=depth * k, quotas=quotas,
                     fill_quotas=True)
    trees = beam.grow(step, None, reqs, roots, hidden)
    assert [len(t) for t in trees] == [quota] * len(reqs)
    assert step.queued.counts == [quota] * len(reqs)
    _assert_queued_is(step.queued, trees)


def test_async_quota_takes_the_runners_budget_when_it_has_one():
    """``budget_rule "throughput"`` under async scheduling: the model runner's budget (a source in the same
    process) decides the quota; while it has none (None) the calibrated budget does."""
    from vllm_bole.config import BoleConfig
    from vllm_bole.worker.scheduler import async_budget, async_quotas

    cfg = BoleConfig(budget=36)
    asked = []

    def source(batch, context_len):
        asked.append((batch, context_len))
        return 96 if batch == 4 else None

    assert async_quotas(async_budget(cfg, 4, 100, source=source)[0], 32, 4)[0] == 24
    assert async_quotas(async_budget(cfg, 4, 100, source=source)[0], 16, 4)[0] == 16   # at most num_spec_tokens
    assert async_quotas(async_budget(cfg, 6, 50, source=source)[0], 32, 6)[0] == 6     # no budget yet: 36 // 6
    assert asked == [(4, 100), (4, 100), (6, 50)]


def test_budget_log_says_how_often_the_rule_chose(caplog):
    """The scheduler counts each step's budget and who chose it, and logs one line per stats interval: the
    throughput rule's share (the others took the calibrated B_ver), the nodes each request got, the batches."""
    import logging

    from vllm_bole.config import BoleConfig
    from vllm_bole.spec_decode.budget import BudgetLog
    from vllm_bole.worker import scheduler as sched_mod

    cfg = BoleConfig(budget=36)   # 8 levels x topk 4: at most 32 nodes a request
    log = BudgetLog(interval_s=10.0)
    clock = iter([0.0, 1.0, 2.0, 3.0, 10.5, 11.0])
    source = {4: 96, 6: None, 1: 64}
    lines = []
    for batch in (4, 4, 6, 6, 1, 4):   # as the async scheduler counts a step: its quota times its requests
        budget, by_rule = sched_mod.async_budget(cfg, batch, 100, source=lambda b, c: source[b])
        k, _ = sched_mod.async_quotas(budget, cfg.max_nodes_per_request, batch)
        lines.append(log.record(batch, k * batch, by_rule, next(clock)))
    # 4 requests x 24, 4 x 24, 6 x 6 (B_ver 36 split), 6 x 6, then 1 x 32 (capped) ends the interval at 10.5 s
    assert lines[:4] == [None] * 4 and lines[5] is None
    assert lines[4] == ("Bole budget: 5 steps in the last 10.5 s, 60% chosen by the throughput rule; "
                        f"{(24 * 8 + 6 * 12 + 32) / 21:.2f} nodes per request, batch 1-6")
    assert log.interval() == {"steps": 1, "by_rule": 1, "nodes": 96, "requests": 4}   # a new interval from 10.5 s
    assert log.totals == {"steps": 6, "by_rule": 4, "nodes": 392, "requests": 25}
    # The CUDA graphs captured in the interval, where some were.
    totals = [(3, 40.0), (3, 40.0), (5, 290.0)]
    log = BudgetLog(interval_s=1.0, captures=lambda: totals.pop(0))
    assert log.record(4, 16, True, 0.0) is None
    assert log.record(4, 16, True, 1.5).endswith("batch 4-4")   # none captured since the log began
    assert log.record(4, 16, True, 3.0).endswith("batch 4-4; 2 CUDA graphs captured (250 ms)")
    # Through vLLM's logger, at INFO.
    with caplog.at_level(logging.INFO, logger="vllm_bole"):
        BudgetLog(interval_s=0.0).record(2, 6, False, 5.0)
    assert any("0% chosen by the throughput rule; 3.00 nodes per request, batch 2-2" in r.getMessage()
               for r in caplog.records)


def test_budget_source_is_linked_per_engine_and_held_weakly():
    """The runner hands the scheduler of its own engine its budget method, keyed by the VllmConfig both are built
    from: another engine's config (or a copy or pickle of it: a worker in another process) holds no source, and a
    runner that is gone leaves none (the scheduler then warns once and uses the calibrated budget)."""
    import copy
    import gc
    import pickle

    from vllm.config import VllmConfig

    from vllm_bole._vllm_compat import engine_link

    class Runner:
        def bole_async_budget(self, batch, context_len):
            return 8 * batch

    config, other = VllmConfig(), VllmConfig()
    runner = Runner()
    engine_link(config).set_budget_source(runner.bole_async_budget)
    assert engine_link(config).budget_source()(2, None) == 16
    assert engine_link(other).budget_source() is None
    assert engine_link(copy.deepcopy(config)).budget_source() is None
    assert engine_link(pickle.loads(pickle.dumps(config))).budget_source() is None
    assert engine_link(config).budget_source()(3, None) == 24   # copies leave the original's link alone
    # vLLM rebuilds configs from their attributes (config.utils.replace, the drafter's config) and refuses any
    # that is no field: the link adds none
    assert set(vars(config)) == set(vars(other))
    del runner
    gc.collect()
    assert engine_link(config).budget_source() is None
    from vllm_bole import _vllm_compat

    links = len(_vllm_compat._LINKS)
    del config
    gc.collect()
    assert len(_vllm_compat._LINKS) == links - 1   # a config that is gone leaves no link behind
