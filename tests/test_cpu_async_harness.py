"""vLLM's async scheduling on CPU (``engine_run``'s ``cpu_async_scheduling``): vLLM 0.26 turns it off for CPU
engines, the harness keeps it on. Pinned here with vLLM's own MTP chain: the engine really schedules with its
batch queue and AsyncScheduler, and its greedy tokens are those of the synchronous engine, so that async work on
Bole's path can be checked on CPU against the same harness (docs/design.md, "Async scheduling")."""

import pytest

from e2e_support import random_requests, run_engine, vocab_size

pytestmark = pytest.mark.vllm


def test_async_scheduling_runs_on_cpu_and_matches_sync(tmp_path, tiny_qwen3_5_dir):
    requests = random_requests(vocab_size(tiny_qwen3_5_dir), [7, 30, 12, 19], max_tokens=24)
    engine = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}, "max_num_seqs": 4}
    outs = {}
    for name, on in (("sync", False), ("async", True)):
        outs[name] = run_engine(tmp_path, f"mtp_{name}", {
            "model": tiny_qwen3_5_dir, "requests": requests, "cpu_async_scheduling": on,
            "engine": engine | {"async_scheduling": on}})
    assert outs["sync"]["scheduling"] == {"async_scheduling": False, "batch_queue": False,
                                          "scheduler": "Scheduler"}, outs["sync"]["scheduling"]
    assert outs["async"]["scheduling"] == {"async_scheduling": True, "batch_queue": True,
                                           "scheduler": "AsyncScheduler"}, outs["async"]["scheduling"]
    tokens = {name: [o["tokens"] for o in out["outputs"]] for name, out in outs.items()}
    assert all(len(t) == 24 for t in tokens["async"]), tokens["async"]
    assert tokens["async"] == tokens["sync"]
    # The chain speculated in both (vLLM's MTP drafter ran under the async runner path too).
    assert outs["async"]["counters"]["num_drafts"] > 0 and outs["sync"]["counters"]["num_drafts"] > 0
