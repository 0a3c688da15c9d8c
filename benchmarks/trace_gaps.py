"""Where a step's GPU sits idle, from a torch.profiler chrome trace (``benchmarks/step_profile.py --trace``).

    python benchmarks/trace_gaps.py TRACE.json[.gz] [--json OUT] [--steps]

Reads the trace's GPU activity (kernels, copies, memsets) and the host's profiling scopes (vLLM's
``gpu_model_runner: ...`` scopes, Bole's ``bole: ...`` scopes and the engine scopes step_profile adds) and prints,
per engine step: the wall time, the GPU's busy time, the GPU's idle time by the innermost host scope running
meanwhile (what the GPU waited for), and the GPU time by the scope that launched it (matched through the
trace's launch-to-kernel flows).
"""

import argparse
import bisect
import gzip
import json
import re
from collections import defaultdict
from pathlib import Path

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}

# Kernel classes by name, first match wins: what a step's GPU time is made of (GEMMs near the weight-read floor,
# or the small kernels around them).
KERNEL_CLASSES = [
    ("gemm", r"nvjet|gemm|cutlass|splitKreduce|xmma|cublas"),
    ("commit/kv move", r"commit|compact"),
    ("gdn", r"delta|gdn|recurrent|chunk_|solve_tril|l2norm|tree_matrices|tree_values"),
    ("conv1d", r"conv"),
    ("attention", r"flash|attn|fmha|reshape_and_cache"),
    ("tree bookkeeping", r"ancestor|tree_walk|synthetic|quota"),
    ("sort/top-k", r"topk|sort|radix|bitonic|scan|cumsum"),
    ("inductor", r"^triton_"),
    ("copy/fill", r"memcpy|memset|fill|copy"),
    ("torch elementwise/index/reduce", r"elementwise|index|reduce|gather|scatter|where|arange|cat"),
]


def kernel_class(name: str) -> str:
    for label, pattern in KERNEL_CLASSES:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


class Scopes:
    """Nested host scopes of one thread: the innermost one at any instant."""

    def __init__(self, events: list[dict]):
        self.spans = sorted(((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events), key=lambda s: (s[0], -s[1]))
        points = sorted({p for a, b, _ in self.spans for p in (a, b)})
        self.points = points
        # innermost scope of each elementary segment [points[i], points[i+1]): the latest-starting open scope
        self.label = []
        opened: list[tuple[float, float, str]] = []
        j = 0
        for i, p in enumerate(points[:-1]):
            while j < len(self.spans) and self.spans[j][0] <= p:
                opened.append(self.spans[j])
                j += 1
            opened = [s for s in opened if s[1] > p]
            self.label.append(max(opened, key=lambda s: s[0])[2] if opened else "(no scope)")

    def at(self, t: float) -> str:
        i = bisect.bisect_right(self.points, t) - 1
        return self.label[i] if 0 <= i < len(self.label) else "(no scope)"

    def overlap(self, a: float, b: float, into: dict) -> None:
        """Add the length of [a, b) spent in each innermost scope to ``into``."""
        i = max(bisect.bisect_right(self.points, a) - 1, 0)
        covered = 0.0
        while i < len(self.label) and self.points[i] < b:
            lo, hi = max(a, self.points[i]), min(b, self.points[i + 1])
            if hi > lo:
                into[self.label[i]] += hi - lo
                covered += hi - lo
            i += 1
        if b - a > covered:
            into["(no scope)"] += b - a - covered


def analyze(events: list[dict]) -> dict:
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS]
    scopes = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"]
    if not gpu or not scopes:
        raise SystemExit("the trace has no GPU activity or no host scopes (VLLM_CUSTOM_SCOPES_FOR_PROFILING=1?)")
    # The host thread that runs the engine: the one with the most scopes.
    by_thread = defaultdict(list)
    for e in scopes:
        by_thread[(e["pid"], e["tid"])].append(e)
    main = max(by_thread.values(), key=len)
    host = Scopes(main)
    steps = [e for e in main if e["name"] == "engine: schedule"]
    start = min(e["ts"] for e in steps) if steps else min(e["ts"] for e in main)
    end = max(e["ts"] + e["dur"] for e in main)
    busy = _union([(max(e["ts"], start), min(e["ts"] + e["dur"], end)) for e in gpu
                   if e["ts"] + e["dur"] > start and e["ts"] < end])
    idle_by = defaultdict(float)
    prev = start
    for a, b in busy:
        if a > prev:
            host.overlap(prev, a, idle_by)
        prev = b
    if end > prev:
        host.overlap(prev, end, idle_by)
    # GPU time by the scope that launched it: flow "s" (launch, on the host) -> "f" (kernel), same id.
    launch_ts = {}
    for e in events:
        if e.get("ph") == "s" and e.get("cat") == "ac2g":
            launch_ts[e["id"]] = e["ts"]
    kernel_flow = {}
    for e in events:
        if e.get("ph") == "f" and e.get("cat") == "ac2g" and e["id"] in launch_ts:
            kernel_flow[(e["pid"], e["tid"], e["ts"])] = launch_ts[e["id"]]
    gpu_by, by_class = defaultdict(float), defaultdict(float)
    for e in gpu:
        if not start <= e["ts"] < end:
            continue
        t = kernel_flow.get((e["pid"], e["tid"], e["ts"]))
        if t is None:
            corr = e.get("args", {}).get("correlation")
            t = launch_ts.get(corr)
        scope = host.at(t) if t is not None else "(unmatched)"
        gpu_by[scope] += e["dur"]
        by_class[(scope, kernel_class(e["name"]))] += e["dur"]
    n = max(len(steps), 1)
    wall = end - start
    busy_us = sum(b - a for a, b in busy)
    return {"steps": len(steps), "wall_ms_per_step": wall / n / 1e3, "gpu_busy_ms_per_step": busy_us / n / 1e3,
            "gpu_idle_ms_per_step_by_scope": {k: v / n / 1e3 for k, v in sorted(idle_by.items(), key=lambda kv: -kv[1])},
            "gpu_ms_per_step_by_launching_scope": {k: v / n / 1e3
                                                   for k, v in sorted(gpu_by.items(), key=lambda kv: -kv[1])},
            "gpu_ms_per_step_by_scope_and_kernel_class": {
                f"{scope} | {cls}": v / n / 1e3 for (scope, cls), v in sorted(by_class.items(), key=lambda kv: -kv[1])}}


def per_step(events: list[dict], top: int = 6) -> list[dict]:
    """Each engine step (from one ``engine: schedule`` to the next): wall and GPU busy time, and its ``top``
    host scopes by GPU idle time (the means of :func:`analyze` mix warm-up or capture steps into steady ones)."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS]
    by_thread = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "user_annotation":
            by_thread[(e["pid"], e["tid"])].append(e)
    main = max(by_thread.values(), key=len)
    host = Scopes(main)
    starts = sorted(e["ts"] for e in main if e["name"] == "engine: schedule")
    bounds = starts + [max(e["ts"] + e["dur"] for e in main)]
    busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    out = []
    for a, b in zip(bounds, bounds[1:]):
        spans = [(max(x, a), min(y, b)) for x, y in busy if y > a and x < b]
        idle, prev = defaultdict(float), a
        for x, y in spans:
            if x > prev:
                host.overlap(prev, x, idle)
            prev = max(prev, y)
        if b > prev:
            host.overlap(prev, b, idle)
        ranked = sorted(idle.items(), key=lambda kv: -kv[1])[:top]
        out.append({"wall_ms": (b - a) / 1e3, "gpu_busy_ms": sum(y - x for x, y in spans) / 1e3,
                    "gpu_idle_ms_by_scope": {k: v / 1e3 for k, v in ranked}})
    return out


def report(result: dict, title: str = "") -> str:
    lines = [f"{title}{result['steps']} engine steps: wall {result['wall_ms_per_step']:.2f} ms/step, GPU busy "
             f"{result['gpu_busy_ms_per_step']:.2f} ms/step", "", "| GPU idle while the host runs | ms/step |",
             "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in result["gpu_idle_ms_per_step_by_scope"].items() if v >= 0.005]
    lines += ["", "| GPU time launched from | ms/step |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in result["gpu_ms_per_step_by_launching_scope"].items() if v >= 0.005]
    lines += ["", "| GPU time launched from | kernel class | ms/step |", "|---|---|---|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in result["gpu_ms_per_step_by_scope_and_kernel_class"].items() if v >= 0.005]
    return "\n".join(lines)


def step_lines(events: list[dict]) -> list[str]:
    """One line per engine step: its wall time, GPU busy time and GPU idle time by host scope."""
    lines = []
    for i, step in enumerate(per_step(events)):
        idle = ", ".join(f"{k} {v:.2f}" for k, v in step["gpu_idle_ms_by_scope"].items())
        lines.append(f"step {i}: wall {step['wall_ms']:.2f} ms, GPU busy {step['gpu_busy_ms']:.2f} ms; idle: {idle}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--json", type=Path, help="also write the numbers as JSON")
    parser.add_argument("--steps", action="store_true", help="also one line per engine step")
    args = parser.parse_args()
    events = load(args.trace)
    result = analyze(events)
    print(report(result, f"{args.trace.name}: "))
    if args.steps:
        print("\n" + "\n".join(step_lines(events)))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
