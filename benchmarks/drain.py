"""How long a batch of equal requests takes to drain, in steps, under synthetic acceptance (no GPU, no engine).

    python3 benchmarks/drain.py [--batch-sizes 16 32 64] [--new-tokens 256] [--depths 3 8] [--batches 200]

``e2e.py`` times B requests that each want ``--new-tokens`` tokens. Each step a request gains its accepted drafts
plus one; it finishes once it holds its tokens, and the batch runs until its last request does. A chain of depth d
under ``vllm_bole.spec_decode.synthetic`` accepts like vLLM's synthetic chain with the same rates (depth 3: MTP
k=3; depth 8: Bole's trees at 8 nodes per request, which the synthetic scores make chains). More tokens per step
with a wider spread means the requests finish further apart: the batch's last step comes later relative to the
mean. With every step taking the same time, a whole run's tok/s is then ``mean steps / last step`` of what the
steps with the whole batch decoding give (tail steps hold fewer requests and cost somewhat less: a lower bound).
Prints a table; the first request gets its first token from the prefill.
"""

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_bole.spec_decode.synthetic import SyntheticAcceptance  # noqa: E402


def chain(depth: int) -> list[int]:
    """Parents of a chain of ``depth`` nodes below its root."""
    return [-1] + list(range(depth))


def drain(batch_size: int, new_tokens: int, depth: int, acceptance: SyntheticAcceptance) -> tuple[int, int]:
    """One batch: (the step at which its first request finishes, the step at which its last does)."""
    tree = chain(depth)
    left = [new_tokens - 1] * batch_size   # the prefill gave each its first token
    step, first = 0, None
    while any(n > 0 for n in left):
        step += 1
        for i, n in enumerate(left):
            if n > 0:
                left[i] = n - len(acceptance.walk(tree))
                if left[i] <= 0 and first is None:
                    first = step
    return first, step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--depths", type=int, nargs="+", default=[3, 8])
    p.add_argument("--batches", type=int, default=200, help="simulated batches per cell")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    acceptance = SyntheticAcceptance(seed=args.seed)
    print("| chain depth | B | tokens/step | mean steps | first finish | last step | whole run / full-batch tok/s |")
    print("|---|---|---|---|---|---|---|")
    for depth in args.depths:
        tree = chain(depth)
        per_step = statistics.mean(len(acceptance.walk(tree)) for _ in range(100_000))
        mean_steps = (args.new_tokens - 1) / per_step
        for b in args.batch_sizes:
            runs = [drain(b, args.new_tokens, depth, acceptance) for _ in range(args.batches)]
            first = statistics.mean(r[0] for r in runs)
            last = statistics.mean(r[1] for r in runs)
            print(f"| {depth} | {b} | {per_step:.2f} | {mean_steps:.1f} | {first:.1f} | {last:.1f} | "
                  f"{mean_steps / last:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
