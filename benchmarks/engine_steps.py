"""Where a timed ``LLM.generate`` run's wall time goes, step by step, for any configuration (AR, MTP, Bole).

A batch of B requests that all want the same number of new tokens runs in three phases: the prompts' prefill
(chunked into several steps), steps with all B requests decoding, and the tail, where requests that accepted
more tokens per step have finished and the rest drain in smaller and smaller batches. Tree speculation accepts
more tokens per step but with a wider spread than a chain, so its requests finish further apart: its tail is a
larger share of a run. tok/s over the whole run mixes the three; the full-batch steps alone are what a server
holding B requests in flight sees.

:class:`EngineSteps` wraps ``llm.llm_engine.step`` (``LLM`` calls it once per engine step; the engine core runs in
this process) and logs, after each step, the time, the requests running and the output tokens they hold.
:func:`summarize` splits a run at its full-batch steps.
"""

import dataclasses
import statistics
import time


@dataclasses.dataclass
class RunSteps:
    start: float
    end: float = 0.0
    # after each engine step: (time, requests running, of them with an output token, their output tokens)
    log: list[tuple[float, int, int, int]] = dataclasses.field(default_factory=list)


class EngineSteps:
    """``with steps.run() as run: llm.generate(...)`` logs that call's engine steps into ``run``."""

    def __init__(self, llm):
        from vllm_bole._vllm_compat import engine_core_of

        self.engine = llm.llm_engine
        self.scheduler = engine_core_of(llm).scheduler
        self._run: RunSteps | None = None
        inner = self.engine.step

        def step():
            out = inner()
            if self._run is not None:
                running = self.scheduler.running
                counts = [r.num_output_tokens for r in running]
                self._run.log.append((time.perf_counter(), len(counts), sum(1 for c in counts if c > 0),
                                      sum(counts)))
            return out

        self.engine.step = step   # an instance attribute: LLM's loop looks it up on every step

    def run(self):
        steps = self

        class _Run:
            def __enter__(self):
                steps._run = RunSteps(start=time.perf_counter())
                return steps._run

            def __exit__(self, *exc):
                steps._run.end = time.perf_counter()
                steps._run = None

        return _Run()


def summarize(run: RunSteps, batch_size: int) -> dict | None:
    """One run: ``steps`` (engine steps), ``prefill_ms`` and ``prefill_steps`` (from the call until every request
    holds a token), ``full_steps`` and ``full_step_ms`` (the steps that began and ended with all ``batch_size``
    requests decoding: their count and median period), ``full_tok_s`` (their tokens over their time), ``tail_ms``
    (after the last full-batch step until the call returned), ``tail_steps`` and ``tail_step_ms`` (their median
    period: whether a step of a draining batch costs less than a full one). None when no step ran with the whole
    batch decoding (a batch that never fit at once)."""
    log = run.log
    first = next((i for i, (_, n, started, _) in enumerate(log) if n == batch_size and started == batch_size), None)
    if first is None:
        return None
    periods, tokens, last = [], 0, first
    for i in range(first + 1, len(log)):
        (t0, n0, _, k0), (t1, n1, _, k1) = log[i - 1], log[i]
        if n0 == batch_size and n1 == batch_size:
            periods.append(t1 - t0)
            tokens += k1 - k0
            last = i
    full_s = sum(periods)
    tail = [log[i][0] - log[i - 1][0] for i in range(last + 1, len(log))]
    return {"steps": len(log), "prefill_ms": (log[first][0] - run.start) * 1e3, "prefill_steps": first + 1,
            "full_steps": len(periods), "full_step_ms": statistics.median(periods) * 1e3 if periods else None,
            "full_tok_s": tokens / full_s if full_s > 0 else None,
            "tail_ms": (run.end - log[last][0]) * 1e3, "tail_steps": len(tail),
            "tail_step_ms": statistics.median(tail) * 1e3 if tail else None}


def combine(summaries: list[dict | None]) -> dict | None:
    """The timed runs' summaries as one row entry: the median of each field over the runs (rounded)."""
    summaries = [s for s in summaries if s is not None]
    if not summaries:
        return None
    out = {}
    for key in summaries[0]:
        values = [s[key] for s in summaries if s[key] is not None]
        out[key] = round(statistics.median(values), 2) if values else None
    return out
