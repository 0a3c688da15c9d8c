"""A finishing request publishes the full blocks its last step computed (``publish_blocks_when_finished``): vLLM
publishes a request's blocks as it allocates the request's next step, so without this the blocks that accepted
drafts of a request's last step completed would be freed unpublished. The engine tests reach that case only where a
last step accepted drafts across a block's end (``tests/test_e2e_prefix_caching.py``); here the wrapper alone."""

from types import SimpleNamespace

from vllm_bole._vllm_compat import publish_blocks_when_finished


class _Scheduler:
    def __init__(self):
        self.calls = []
        self.kv_cache_manager = SimpleNamespace(
            cache_blocks=lambda request, n: self.calls.append(("cache_blocks", request.request_id, n)))

    def _free_request(self, request, delay_free_blocks=False):
        self.calls.append(("free", request.request_id, delay_free_blocks))
        return "freed"


def test_finishing_request_publishes_its_computed_blocks_first():
    scheduler = _Scheduler()
    publish_blocks_when_finished(scheduler)
    done = SimpleNamespace(request_id="a", num_computed_tokens=262, num_tokens=263)
    assert scheduler._free_request(done, delay_free_blocks=True) == "freed"
    # Stopped by a stop string after a step that computed past it: only the request's own tokens.
    stopped = SimpleNamespace(request_id="b", num_computed_tokens=270, num_tokens=265)
    scheduler._free_request(stopped)
    assert scheduler.calls == [("cache_blocks", "a", 262), ("free", "a", True),
                               ("cache_blocks", "b", 265), ("free", "b", False)]
