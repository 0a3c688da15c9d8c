"""The node budget of each drafting step, and what its rule measures (docs/design.md, "The node budget").

The model runner holds one :class:`BudgetPolicy` and asks it once per drafting step: :meth:`BudgetPolicy.plan`
under synchronous scheduling, :meth:`BudgetPolicy.planned_async` where the async scheduler fixed the quotas already
(it asks :meth:`BudgetPolicy.async_budget` for them, handed over by ``_vllm_compat.engine_link``).
"""

import collections
import functools
import time

from .. import envs
from .._vllm_compat import engine_link
from ..config import bole_config_from_vllm
from ..spec_decode.acceptance_model import TREES_PER_STEP, AcceptanceModel, DeviceWalks, chain_nodes
from ..spec_decode.budget import StepClock, auto_budgets, node_budget, verify_ms, with_applicable_rule
from ..spec_decode.synthetic import parse_synthetic


class BudgetPolicy:
    """``budget`` and ``budget_rule`` of the speculative config, with the step clock (the step time besides the
    target forward), the acceptance model (what trees of q nodes accept, from the walks so far) and the counts of
    the budgets it planned. ``per_request``: the most nodes one request may carry (vLLM's
    ``num_speculative_tokens``)."""

    def __init__(self, vllm_config, per_request: int):
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.per_request = per_request
        self.config = bole_config_from_vllm(vllm_config)   # its budget_rule resolved by refresh()
        self.clock = StepClock()
        self.acceptance = AcceptanceModel(self.config.topk, self.config.max_depth)
        # walks that stayed on the device (async scheduling), on their way to the acceptance model
        self.device_walks = DeviceWalks(self.acceptance)
        self.planned = collections.Counter()         # (batch size, node budget) of every planned step
        self.async_planned = collections.Counter()   # (batch size, budget) given to the async scheduler
        # synchronous scheduling: the last step's (batch size, nodes, by the throughput rule), for the scheduler's
        # BudgetLog (it travels on the step's draft token ids)
        self.choice: tuple[int, int, bool] | None = None
        self._chosen: dict[int, int] = {}   # "throughput": batch size -> the budget last chosen (not a probe)
        self._graphs = 0   # CUDA graphs held at the clock's last tick
        self._synthetic_chain_nodes = synthetic_chain_nodes(self.config)
        self.refresh()

    @property
    def rule(self) -> str:
        return self.config.budget_rule

    def refresh(self) -> None:
        """``budget_rule`` as it applies with the calibration table as it is now (:func:`with_applicable_rule`:
        "throughput" needs T_ver curves); called again after a table was written in this process
        (``budget.reload_budget_tables``). Under "throughput" the async scheduler of this engine asks
        :meth:`async_budget`."""
        self.config = with_applicable_rule(bole_config_from_vllm(self.vllm_config), self.model_config)
        if self.rule == "throughput":
            engine_link(self.vllm_config).set_budget_source(self.async_budget)

    def tick(self, num_reqs: int, context_len: int | None, tree_only: bool, verified_nodes: int,
             graphs: int) -> None:
        """One step of the step clock, once per step when drafting starts: the step just run (``tree_only``:
        its batch held trees only) verified ``verified_nodes``; ``graphs``: the CUDA graphs held now (a change
        since the last tick means a capture, which the clock leaves out)."""
        captured, self._graphs = graphs != self._graphs, graphs
        self.clock.tick(time.perf_counter(), num_reqs, tree_only,
                        verify_ms(self.config, num_reqs, verified_nodes, context_len, self.model_config),
                        nodes=verified_nodes, captured=captured)

    def plan(self, num_reqs: int, context_len: int | None) -> int:
        """The node budget of a synchronous step of ``num_reqs`` requests (the clock ticked for it already under
        the rules "step" and "throughput")."""
        rest = None
        if self.rule == "throughput" and self.acceptance.ready:
            rest = self.clock.rest_model(num_reqs)   # the rest as it grows with the trees
            budget = self._throughput(num_reqs, context_len, rest)
        else:
            rest_ms = self.clock.rest_ms(num_reqs) if self.rule != "decode" else None
            budget = node_budget(self.config, num_reqs, model_config=self.model_config, context_len=context_len,
                                 rest_ms=rest_ms)
        self.planned[num_reqs, budget] += 1
        self.choice = (num_reqs, min(budget, num_reqs * self.per_request), rest is not None)
        return budget

    def planned_async(self, num_reqs: int, budget: int) -> None:
        """A step of ``num_reqs`` requests under async scheduling carries ``budget`` nodes (the scheduler's
        quotas)."""
        self.planned[num_reqs, budget] += 1

    def async_budget(self, batch_size: int, context_len: int | None) -> int | None:
        """The node budget of a step of ``batch_size`` decodes under ``budget_rule "throughput"``, for the async
        scheduler: the calibrated N with the most expected tokens per unit of step time. None until the acceptance
        model and the step clock have measurements at this batch size (the scheduler then uses B_ver)."""
        rest = self.clock.rest_model(batch_size)
        if rest is None or not self.acceptance.ready:
            return None
        budget = self._throughput(batch_size, context_len, rest)
        self.async_planned[batch_size, budget] += 1
        return budget

    def width(self, nodes_per_request: int) -> int | None:
        """The drafter's beam width for a step whose trees hold up to ``nodes_per_request`` nodes each: 1 where
        the best-first tree of that many nodes is a chain (:meth:`chain_nodes`), so a ``topk``-wide beam would
        draft nothing the selection keeps besides the chain, at ``topk`` times the rows per level; else None
        (``topk``)."""
        limit = min(self.chain_nodes(), self.config.max_depth)   # (a chain holds max_depth nodes at most)
        return 1 if self.config.topk > 1 and 0 < nodes_per_request <= limit else None

    def chain_nodes(self) -> int:
        """The most nodes per request whose best-first tree is a chain: ``VLLM_BOLE_CHAIN_NODES`` if set, else by
        the acceptance model's rates once it has measurements, else by ``synthetic_acceptance``'s, else 0 (no
        rates: always the full beam)."""
        forced = envs.VLLM_BOLE_CHAIN_NODES
        if forced is not None:
            return forced
        if self.acceptance.ready:
            return self.acceptance.chain_nodes()
        return self._synthetic_chain_nodes

    def estimates(self, batch_size: int, context_len: int | None = None) -> list[dict] | None:
        """What ``budget_rule "throughput"`` weighs now at ``batch_size`` (``ModelBudgets.throughput_estimates``:
        per calibrated N, T_ver, the step clock's rest, the acceptance model's tokens and their rate), for reports;
        None under another rule or before the clock and the acceptance model have measurements."""
        rest = self.clock.rest_model(batch_size)
        budgets = auto_budgets(self.config, self.model_config)
        if self.rule != "throughput" or rest is None or budgets is None or not self.acceptance.ready:
            return None
        return budgets.throughput_estimates(batch_size, context_len, rest, self._tokens(batch_size))

    def observe(self, forest) -> None:
        """The step's accepted paths (``forest.accepted_paths``) into the acceptance model (``budget_rule
        "throughput"``; the first ``TREES_PER_STEP`` trees of a step)."""
        if self.rule == "throughput" and forest.accepted_paths:
            n = min(len(forest.tree_req_indices), TREES_PER_STEP)
            self.acceptance.observe([forest.parents_of(i) for i in range(n)], forest.accepted_paths[:n])

    def _tokens(self, batch_size: int):
        return functools.partial(self.acceptance.tokens_per_step, batch=batch_size, per_request=self.per_request)

    def _throughput(self, batch_size: int, context_len: int | None, rest) -> int:
        """The table's choice from the expected tokens and ``rest`` (N -> ms), kept from the last one unless
        clearly better, or one calibrated size off it on a probe (:meth:`StepClock.probe`)."""
        probe = self.clock.probe(batch_size)
        budget = node_budget(self.config, batch_size, model_config=self.model_config, context_len=context_len,
                             rest_ms=rest, tokens=self._tokens(batch_size), probe=probe,
                             keep=self._chosen.get(batch_size))
        if not probe:
            self._chosen[batch_size] = budget
        return budget


def synthetic_chain_nodes(bole_config) -> int:
    """:func:`acceptance_model.chain_nodes` at the rates of ``synthetic_acceptance`` (0 without it)."""
    synthetic = parse_synthetic(bole_config.synthetic_acceptance)
    if synthetic is None:
        return 0
    # Inside the draft vocabulary: its coverage scales every child alike and cancels out of the comparison.
    first = [synthetic.in_vocab_rank1_rate(d) for d in range(1, bole_config.max_depth + 1)]
    return chain_nodes(first, list(synthetic.sibling_rates), bole_config.topk, bole_config.max_depth)
