"""Which steps without drafts run from the verification graphs as one-node trees (worker/model_runner.py):
only steps of decodes alone (one token each, prompts done), and only when Bole's graphs exist."""

from types import SimpleNamespace

import numpy as np

from vllm_bole.worker.model_runner import BoleModelRunnerMixin


def _runner(computed, prompt, graphs=True):
    batch = SimpleNamespace(num_computed_tokens_cpu=np.array(computed + [0] * 4),
                            num_prompt_tokens=np.array(prompt + [0] * 4))
    return SimpleNamespace(_bole_graphs=object() if graphs else None, input_batch=batch)


def test_plain_decode_step_rule():
    step = BoleModelRunnerMixin._plain_decode_step
    assert step(_runner([10, 20, 5], [10, 3, 5]), np.array([1, 1, 1]))
    assert not step(_runner([10, 20, 5], [10, 3, 5], graphs=False), np.array([1, 1, 1]))   # CPU / eager
    assert not step(_runner([10, 20, 5], [10, 3, 5]), np.array([1, 2, 1]))                 # a chunk of 2
    assert not step(_runner([10, 20, 4], [10, 3, 5]), np.array([1, 1, 1]))                 # last prompt token
    assert not step(_runner([], []), np.array([], dtype=np.int64))
