"""The acceptance model behind ``budget_rule "throughput"`` (spec_decode/acceptance_model.py) and the rule's
lookup: the best-first curve against brute force, the rates recovered from synthetic walks (deep paths, later
siblings, censored ranks), the even split of a budget, and the table's choice of N."""

import collections
import itertools
import random

import pytest

from forest_shapes import full_tree
from vllm_bole.spec_decode.budget_table import ModelBudgets
from vllm_bole.spec_decode.acceptance_model import (DECAY, WALKS_PER_DECAY, AcceptanceModel, best_first_curve,
                                                    child_probability)
from vllm_bole.spec_decode.queued_drafts import quotas_of
from vllm_bole.spec_decode.synthetic import SyntheticAcceptance
from vllm_bole.testing.budget_loop import closed_loop


@pytest.mark.parametrize("seed", range(6))
def test_best_first_curve_is_the_sum_of_the_most_probable_paths(seed):
    rng = random.Random(seed)
    k, depth = rng.choice([(1, 5), (2, 4), (3, 3), (4, 2)])
    first = [rng.random() for _ in range(depth)]
    sib = [rng.random() for _ in range(k - 1)]
    # Every node of the full tree: its path of ranks; its probability is the product along it.
    probs = []
    for d in range(1, depth + 1):
        for ranks in itertools.product(range(k), repeat=d):
            p = 1.0
            for level, r in enumerate(ranks, start=1):
                p *= child_probability(first, sib, level, r)
            probs.append(p)
    probs.sort(reverse=True)
    curve = best_first_curve(first, sib, k, depth)
    for q in range(len(curve)):
        assert curve[q] == pytest.approx(1.0 + sum(probs[:q]), rel=1e-9, abs=1e-12)
    assert len(curve) - 1 == sum(p > 0 for p in probs)


def test_rates_recovered_from_synthetic_walks_with_censored_ranks():
    """Walks over full 3-ary trees of depth 4 under known rates: the model's rates and curve match them; a
    model fed chains only sees no sibling ranks (censored) but the same rank-1 rates."""
    synthetic = SyntheticAcceptance(rates=(0.9, 0.72, 0.5, 0.3), sibling_rates=(0.4, 0.25), seed=1)
    tree, chain = full_tree(3, 4), full_tree(1, 4)
    model, chains = AcceptanceModel(topk=3, max_depth=4), AcceptanceModel(topk=3, max_depth=4)
    assert not model.ready
    for _ in range(150):
        model.observe([tree] * 64, [synthetic.walk(tree) for _ in range(64)])
        chains.observe([chain] * 64, [synthetic.walk(chain) for _ in range(64)])
    assert model.ready and model.steps == 150
    first, sib = model.rates()
    want = [synthetic.rank1_rate(d) for d in range(1, 5)]
    assert first == pytest.approx(want, abs=0.04)
    assert sib == pytest.approx([0.4, 0.25], abs=0.04)
    truth = best_first_curve(want, [0.4, 0.25], 3, 4)
    for q in (1, 3, 8, 12):
        assert model.accepted(q) == pytest.approx(truth[q], rel=0.03)
    assert model.accepted(40) == model.accepted(12)    # a request carries at most topk * max_depth nodes
    c_first, c_sib = chains.rates()
    assert c_first == pytest.approx(want, abs=0.04) and c_sib == [0.0, 0.0]
    assert model.accepted(0) == 1.0


def test_memory_counts_walks_not_steps():
    """The counts fade per walk seen: one walk a step (batch 1) keeps hundreds of walks behind the rates, 32 a
    step keep about as many (not 32 times more), and a step without walks forgets nothing."""
    synthetic = SyntheticAcceptance(seed=3)
    chain = full_tree(1, 8)
    one, many = AcceptanceModel(topk=4, max_depth=8), AcceptanceModel(topk=4, max_depth=8)
    for _ in range(1200):
        one.observe([chain], [synthetic.walk(chain)])
    for _ in range(150):
        many.observe([chain] * 32, [synthetic.walk(chain) for _ in range(32)])
    memory = WALKS_PER_DECAY / (1 - DECAY)   # 400 walks
    assert one.first_trials[1] == pytest.approx(memory, rel=0.15)   # 50 with a decay per step
    assert many.first_trials[1] == pytest.approx(memory, rel=0.15)  # 1600 with a decay per step
    trials = one.first_trials.copy()
    one.observe([], [])
    assert (one.first_trials == trials).all()
    first, _ = one.rates()
    assert first[:4] == pytest.approx([synthetic.rank1_rate(d) for d in range(1, 5)], abs=0.06)


def test_deep_rates_extend_the_last_measured_one():
    """Trees of depth 2 say nothing of depth 3 on: the deeper rank-1 rates repeat depth 2's."""
    model = AcceptanceModel(topk=2, max_depth=5)
    tree = full_tree(2, 2)
    synthetic = SyntheticAcceptance(rates=(0.8, 0.4), sibling_rates=(0.5,), seed=0)
    for _ in range(100):
        model.observe([tree] * 32, [synthetic.walk(tree) for _ in range(32)])
    first, _ = model.rates()
    assert first[1] == pytest.approx(0.5, abs=0.05)
    assert first[2:] == [first[1]] * 3


def test_tokens_per_step_splits_the_budget_like_the_quotas():
    model = AcceptanceModel(topk=2, max_depth=3)
    tree = full_tree(2, 3)
    synthetic = SyntheticAcceptance(rates=(0.9, 0.8, 0.6), sibling_rates=(0.5,), seed=2)
    for _ in range(20):
        model.observe([tree] * 16, [synthetic.walk(tree) for _ in range(16)])
    for nodes, batch, cap in [(10, 4, 32), (3, 4, 32), (64, 4, 6), (0, 3, 8)]:
        want = sum(model.accepted(q) for q in quotas_of([True] * batch, cap, nodes))
        assert model.tokens_per_step(nodes, batch, cap) == pytest.approx(want)


def _budgets(points, t_dec=10.0, b_ver=64):
    entry = {"fingerprint": "m", "gpu": "g", "batch_size": 16, "kv_len": 256, "b_ver": b_ver, "epsilon": 0.1,
             "t_dec_ms": t_dec, "points": [{"nodes": n, "t_ver_ms": t} for n, t in points]}
    return ModelBudgets.from_entries([entry])


def test_throughput_lookup_picks_the_most_tokens_per_millisecond():
    budgets = _budgets([(64, 10.5), (128, 11.0), (256, 14.0), (512, 20.0)])
    gain = {64: 60.0, 128: 80.0, 256: 90.0, 512: 95.0}.get
    # rest 5 ms: 60/15.5 = 3.87, 80/16 = 5.0, 90/19 = 4.74, 95/25 = 3.8
    assert budgets.lookup_throughput(16, 256, 5.0, gain) == 128
    # a long rest makes the extra verification cheap: 80/56 = 1.43, 90/59 = 1.53, 95/65 = 1.46
    assert budgets.lookup_throughput(16, 256, 45.0, gain) == 256
    # a tie goes to the smaller N
    assert budgets.lookup_throughput(16, 256, 5.0, lambda n: 16 + n * 0.0) == 64
    # a rest that grows with the trees (more levels, a wider first pass) moves the choice down:
    # 60/(5 + 0.04*64 + 10.5) = 3.31, 80/(5 + 5.12 + 11) = 3.79, 90/(5 + 10.24 + 14) = 3.08
    assert budgets.lookup_throughput(16, 256, lambda n: 5.0 + 0.04 * n, gain) == 128
    # 45 ms flat picked 256; with 0.1 ms per node the rest at 256 is 70.6: 80/67.8 = 1.18 > 90/84.6 = 1.06
    assert budgets.lookup_throughput(16, 256, lambda n: 45.0 + 0.1 * n, gain) == 128


def test_throughput_estimates_list_what_the_lookup_weighs():
    """The rule's view per calibrated N from B_ver (for e2e.py's rows): T_ver, the rest, the tokens and their rate;
    the lookup's choice is the best rate."""
    budgets = _budgets([(64, 10.5), (128, 11.0), (256, 14.0), (512, 20.0)], b_ver=128)
    gain = {64: 60.0, 128: 80.0, 256: 90.0, 512: 95.0}.get
    rows = budgets.throughput_estimates(16, 256, lambda n: 5.0 + 0.01 * n, gain)
    assert [r["nodes"] for r in rows] == [128, 256, 512]
    assert rows[0] == {"nodes": 128, "t_ver_ms": 11.0, "rest_ms": 6.28, "tokens": 80.0,
                       "tokens_per_ms": round(80.0 / 17.28, 4)}
    best = max(rows, key=lambda r: r["tokens_per_ms"])["nodes"]
    assert best == budgets.lookup_throughput(16, 256, lambda n: 5.0 + 0.01 * n, gain) == 128
    assert budgets.throughput_estimates(16, 256, 5.0, gain)[2]["rest_ms"] == 5.0   # a flat rest
    assert ModelBudgets.from_entries([{"fingerprint": "m", "gpu": "g", "batch_size": 16, "kv_len": 256,
                                       "b_ver": 64}]).throughput_estimates(16, 256, 5.0, gain) == []   # no curve


def test_throughput_lookup_probes_the_neighbouring_sizes():
    budgets = _budgets([(64, 10.5), (128, 11.0), (256, 14.0), (512, 20.0)])
    gain = {64: 60.0, 128: 80.0, 256: 90.0, 512: 95.0}.get
    assert [budgets.lookup_throughput(16, 256, 5.0, gain, probe) for probe in (-1, 0, 1, 2, 5, -3)] == [
        64, 128, 256, 512, 512, 64]   # within the calibrated sizes


def test_throughput_lookup_keeps_the_last_choice_unless_another_is_clearly_better():
    budgets = _budgets([(64, 10.5), (128, 11.0), (256, 14.0), (512, 20.0)])
    # rest 5 ms: 64 -> 60 / 15.5 = 3.871, 128 -> 80 / 16 = 5.0, 256 -> 98 / 19 = 5.158 (3.2% better than 128)
    gain = {64: 60.0, 128: 80.0, 256: 98.0, 512: 99.0}.get
    assert budgets.lookup_throughput(16, 256, 5.0, gain) == 256
    assert budgets.lookup_throughput(16, 256, 5.0, gain, keep=128) == 256        # more than 3% better: switch
    close = {64: 60.0, 128: 80.0, 256: 97.0, 512: 99.0}.get                      # 97 / 19 = 5.105: 2.1% better
    assert budgets.lookup_throughput(16, 256, 5.0, close, keep=128) == 128
    assert budgets.lookup_throughput(16, 256, 5.0, close, keep=100) == 256       # not a calibrated size
    assert budgets.lookup_throughput(16, 256, 5.0, close, probe=1, keep=128) == 256   # probes move off the kept


def test_throughput_lookup_never_goes_below_b_ver():
    """Sizes below the calibrated B_ver are never chosen, however they look: the choice, the probes and a kept
    size below it all land on B_ver or above; a bucket whose curve ends below B_ver gets B_ver."""
    budgets = _budgets([(64, 10.5), (128, 11.0), (256, 14.0), (512, 20.0)], b_ver=128)
    gain = {64: 60.0, 128: 62.0, 256: 63.0, 512: 64.0}.get   # 64 nodes would be best: 60 / 15.5 = 3.87
    assert budgets.lookup_throughput(16, 256, 5.0, gain) == 128                  # 62 / 16 = 3.88 > 63 / 19
    assert [budgets.lookup_throughput(16, 256, 5.0, gain, probe) for probe in (-1, 1)] == [128, 256]
    assert budgets.lookup_throughput(16, 256, 5.0, gain, keep=64) == 128
    short = _budgets([(16, 10.0), (32, 10.2)], b_ver=48)
    assert short.lookup_throughput(16, 256, 5.0, lambda n: float(n)) == 48


@pytest.mark.parametrize("lag", [0, 1, 2])
def test_probes_find_a_rest_that_grows_with_the_trees(lag):
    """A closed loop of the throughput rule against steps whose rest grows steeply with the nodes per request
    (drafter levels): measured at one size only, the fit is flat and charges smaller trees the rest of larger
    ones, so the choice never moves; the probes spread the sizes, the slope appears, and the choice settles on
    the best size. ``lag``: each measured period is that of the step ``lag`` budgets before the one recorded with
    it (under async scheduling the host runs ahead of the device): the fit's steady periods and the probe runs
    find the slope all the same."""
    t_ver = {64: 10.5, 128: 11.0, 256: 14.0, 512: 20.0}
    budgets = _budgets(list(t_ver.items()))
    gain = {64: 60.0, 128: 80.0, 256: 90.0, 512: 95.0}.get

    def rest_of(nodes):   # 2 ms plus 0.05 ms per node: 64 -> 5.2, 128 -> 8.4, 256 -> 14.8, 512 -> 27.6
        return 2.0 + 0.05 * nodes

    def rate(nodes):      # tokens per ms at the true rest: 128 is best (80 / 19.4 against 60 / 15.7, 90 / 28.8)
        return gain(nodes) / (rest_of(nodes) + t_ver[nodes])

    assert max(t_ver, key=rate) == 128

    def run(probing: bool, stall_every: int = 0) -> list[int]:
        # as the budget policy does (BudgetPolicy._throughput; 256 before a fit); a stall of 800 ms (a Triton JIT,
        # a host pause) every ``stall_every`` steps
        def stall_s(i):
            return 0.8 if stall_every and i % stall_every == stall_every - 1 else 0.0

        return closed_loop(budgets, 16, 256, lambda n: t_ver[n] + rest_of(n), gain, 400, lag=lag, probing=probing,
                           start=256, stall_s=stall_s)

    # Flat at 256's rest (14.8 ms): 256 looks best (90 / 28.8 against 80 / 25.8) and stays chosen, forever.
    assert set(run(probing=False)) == {256}
    for stall_every in (0, 37):               # stalls stay out of the clock: the same choice
        last = run(probing=True, stall_every=stall_every)[-100:]
        assert max(set(last), key=last.count) == 128, stall_every
        assert last.count(128) >= 80, stall_every   # the probes stop once the slope is known


def test_measured_budgets_price_every_size_at_zero():
    """budget_table "measured": a batch size's candidates are B x 1, 2, 3, 4, 6, 8, ... nodes a request, up to
    ``per_request``; all at T_ver 0 (the step clock measures whole steps); one node a request is the floor; before
    measurements the table-less default (``budget_table.default_budget``), within the candidates' range."""
    from vllm_bole.spec_decode.budget_table import MeasuredBudgets

    budgets = MeasuredBudgets.for_requests(per_request=10)
    assert [p["nodes"] for p in budgets.throughput_estimates(4, None, 1.0, float)] == \
        [4, 8, 12, 16, 24, 32, 40]
    assert budgets.t_ver_ms(4, 300, 40) == 0.0 and budgets.t_ver_ms(64, None, 1) == 0.0
    assert [budgets.lookup(b) for b in (1, 4, 16, 64, 200)] == [10, 40, 128, 384, 600]   # at least 3 a request
    tokens = {4: 6.0, 8: 6.5, 12: 6.6, 16: 6.7, 24: 6.8, 32: 6.9, 40: 7.0}.get
    assert budgets.lookup_throughput(4, None, lambda n: 10.0 + n / 4, tokens) == 4      # 6 / 11 beats 6.5 / 12
    assert budgets.lookup_throughput(4, None, 10.0, tokens) == 40                       # flat: the most tokens


@pytest.mark.parametrize("batch, knee, per_node, per_request_ms", [
    (1, 64, 0.05, 0.05),      # a flat forward up to 64 nodes: large trees pay
    (8, 128, 0.03, 0.10),
    (64, 128, 0.02, 0.60),    # past the knee from the start: short chains
    (128, 128, 0.025, 0.60),
])
def test_measured_budgets_settle_near_the_best_size(batch, knee, per_node, per_request_ms):
    """A closed loop of the throughput rule without a table: steps whose forward is flat up to ``knee`` nodes and
    grows ``per_node`` ms a node past it, plus ``per_request_ms`` a node per request (drafter levels), timed with
    3% noise; from the start budget the probes find the slope and the choice settles where the expected tokens per
    ms of step come within 5% of the best candidate's, its probes included. Past the knee the rule climbs no
    higher than the sizes it measured (a flat fit would price the largest trees best)."""
    from vllm_bole.spec_decode.budget_table import MeasuredBudgets

    curve = best_first_curve([0.917, 0.837, 0.648, 0.538, 0.451, 0.348, 0.3, 0.25], [0.35, 0.2, 0.1], 4, 8, cap=32)

    def tokens(n):
        return batch * curve[min(n // batch, 32)]

    def step_ms(n):
        return 10.0 + 0.1 * batch + max(0, n - knee) * per_node + per_request_ms * n / batch

    budgets = MeasuredBudgets.for_requests(per_request=32)
    candidates = [p["nodes"] for p in budgets.throughput_estimates(batch, None, 1.0, tokens)]
    best = max(tokens(n) / step_ms(n) for n in candidates)
    chosen = closed_loop(budgets, batch, None, step_ms, tokens, 800, noise=0.03, seed=batch)
    last = chosen[-300:]
    achieved = sum(map(tokens, last)) / sum(map(step_ms, last))   # its probes' steps included
    assert achieved >= 0.95 * best, (collections.Counter(last), {n: tokens(n) / step_ms(n) for n in candidates})
    if knee <= 2 * batch:   # never the largest trees (32 a request): at most one size past those measured
        assert max(chosen) <= 12 * batch, collections.Counter(chosen)


def test_throughput_rule_in_node_budget(tmp_path, monkeypatch):
    from vllm_bole.spec_decode.budget_table import write_table
    from vllm_bole.config import parse_bole_config
    from vllm_bole.spec_decode import budget as budget_mod

    budget_mod.reload_budget_tables()
    monkeypatch.setattr(budget_mod, "device_name", lambda: "g")
    path = tmp_path / "t.json"
    entry = {"fingerprint": "m", "model": "m", "gpu": "g", "batch_size": 16, "kv_len": 256, "b_ver": 64,
             "limited_by_grid": False, "epsilon": 0.1, "t_dec_ms": 10.0, "tree": {}, "device_timing": "x",
             "vllm_version": "0.26.0", "created": "now",
             "points": [{"nodes": n, "t_ver_ms": t} for n, t in [(64, 10.5), (128, 11.0), (256, 14.0)]]}
    write_table(path, [entry])
    cfg, _ = parse_bole_config({"method": "bole", "budget_table": str(path), "budget_rule": "throughput"})
    gain = {64: 60.0, 128: 80.0, 256: 90.0}.get
    assert budget_mod.node_budget(cfg, 16, 300) == 64                               # nothing measured: B_ver
    assert budget_mod.node_budget(cfg, 16, 300, rest_ms=5.0) == 64                   # no acceptance model yet
    assert budget_mod.node_budget(cfg, 16, 300, rest_ms=5.0, tokens=gain) == 128
    # Trees that hardly accept more with more nodes: the smallest N (60 / 15.5 > 60.5 / 16); the step rule,
    # which weighs no acceptance, takes 128 (11.0 <= 1.1 * 10 + 0.1 * 5).
    flat = {64: 60.0, 128: 60.5, 256: 61.0}.get
    assert budget_mod.node_budget(cfg, 16, 300, rest_ms=5.0, tokens=flat) == 64
    step, _ = parse_bole_config({"method": "bole", "budget_table": str(path), "budget_rule": "step"})
    assert budget_mod.node_budget(step, 16, 300, rest_ms=5.0, tokens=flat) == 128
    budget_mod.reload_budget_tables()


def test_device_walks_reach_the_model_as_host_walks_do():
    """Async scheduling keeps a step's walk on the device: :class:`DeviceWalks` copies each step's paths (flat rows
    of the forest, -1 past a path) and the forest's parents, and feeds the model what the host walks would have
    (the same counts as observing the trees and paths directly). Never more than TREES_PER_STEP trees a step."""
    import torch

    from vllm_bole.spec_decode.acceptance_model import TREES_PER_STEP, DeviceWalks

    synthetic = SyntheticAcceptance(rates=(0.9, 0.7, 0.5), sibling_rates=(0.4,), seed=3)
    trees = [full_tree(2, 3), full_tree(1, 3), full_tree(3, 2)]
    direct, via = AcceptanceModel(topk=3, max_depth=3), AcceptanceModel(topk=3, max_depth=3)
    walks = DeviceWalks(via)
    for step in range(20):
        batch = [trees[(step + i) % 3] for i in range(TREES_PER_STEP + 3)]   # more trees than a step observes
        paths = [synthetic.walk(t) for t in batch]
        direct.observe(batch, paths)
        starts = [0]
        for t in batch:
            starts.append(starts[-1] + len(t))
        width = 4
        rows = torch.full((len(batch), width), -1, dtype=torch.long)
        for i, p in enumerate(paths):
            rows[i, :len(p)] = torch.tensor([starts[i] + node for node in p])
        length = torch.tensor([len(p) for p in paths])
        parent = torch.tensor([x for t in batch for x in t], dtype=torch.int32)
        walks.send(rows, length, parent, torch.tensor(starts, dtype=torch.int32))
        assert walks.observe_ready() == 1     # on CPU the copy is the tensor itself: done at once
    assert via.steps == direct.steps == 20
    for a, b in ((via.first_trials, direct.first_trials), (via.first_hits, direct.first_hits),
                 (via.sib_trials, direct.sib_trials), (via.sib_hits, direct.sib_hits)):
        assert a.tolist() == pytest.approx(b.tolist())
    assert via.ready and via.accepted(5) == pytest.approx(direct.accepted(5))
