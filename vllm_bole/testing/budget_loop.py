"""The throughput budget rule in a closed loop, without an engine: the loop of ``BudgetPolicy._throughput`` (the
step clock ticks, probes, the kept choice) against a made-up step cost, for the closed-loop tests and
``benchmarks/budget_rules.py``."""

import random

from ..spec_decode.budget import StepClock


def closed_loop(budgets, batch: int, kv_len: int | None, step_ms, tokens, steps: int, lag: int = 0,
                noise: float = 0.0, seed: int = 0, probing: bool = True, start: int | None = None,
                stall_s=None) -> list[int]:
    """The node budgets the throughput rule chose over ``steps`` steps of ``batch`` requests, from ``start``
    (default: ``budgets.lookup``) until the step clock has a fit. ``step_ms(n)``: the true time of a step of n
    nodes, timed with ``noise`` relative noise; ``tokens(n)``: its expected tokens; ``lag``: each measured period
    is that of the step ``lag`` budgets before the one recorded with it (async scheduling: the host runs ahead of
    the device); ``probing`` False: no probes; ``stall_s(i)``: seconds of stall after step i (a JIT compile, a
    host pause)."""
    rng, clock, now, keep = random.Random(seed), StepClock(), 0.0, None
    chosen = [budgets.lookup(batch, kv_len) if start is None else start] * (lag + 1)
    clock.tick(now, batch, True, budgets.t_ver_ms(batch, kv_len, chosen[-1]), nodes=chosen[-1])
    for i in range(steps):
        ran = chosen[-1 - lag]   # the device runs behind the host's choices under async scheduling
        now += step_ms(ran) * (1 + rng.gauss(0, noise)) / 1e3
        now += stall_s(i) if stall_s is not None else 0.0
        clock.tick(now, batch, True, budgets.t_ver_ms(batch, kv_len, chosen[-1]), nodes=chosen[-1])
        probe, rest = clock.probe(batch) if probing else 0, clock.rest_model(batch)
        nodes = chosen[-1] if rest is None else budgets.lookup_throughput(batch, kv_len, rest, tokens, probe, keep)
        keep = keep if probe else nodes
        chosen.append(nodes)
    return chosen[lag + 1:]
