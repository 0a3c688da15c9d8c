"""The KV cache leaves room for Bole's full CUDA graphs: the runner's graph-memory estimate adds them."""

from types import SimpleNamespace

import torch


class _VLLMRunner:
    def profile_cudagraph_memory(self):
        return 1000


def _runner(graphs, n_gdn, max_capture=100):
    from vllm_bole.attention.gdn import BoleQwenGDN
    from vllm_bole.worker.model_runner import BoleModelRunnerMixin

    cls = type("Runner", (BoleModelRunnerMixin, _VLLMRunner), {})
    runner = object.__new__(cls)
    layers = {}
    for i in range(n_gdn):
        layer = object.__new__(BoleQwenGDN)
        layer.__dict__.update(num_k_heads=4, num_v_heads=8, tp_size=2, head_k_dim=16, head_v_dim=8)
        layers[f"model.layers.{i}.linear_attn"] = layer
    layers["model.layers.9.self_attn.attn"] = SimpleNamespace()
    runner._bole_graphs = graphs
    runner.compilation_config = SimpleNamespace(static_forward_context=layers, max_cudagraph_capture_size=max_capture)
    runner.model_config = SimpleNamespace(dtype=torch.bfloat16)
    return runner


def test_estimate_adds_graph_pools_and_gdn_buffers():
    # 3 GDN layers of 2 key / 4 value heads per rank: factors (2*16 + 4*8 + 4) * 4 B, conv inputs (2*2*16 + 4*8)
    # * 2 B per token and layer; two buffers up to the power-of-two capacity 128.
    per_token = 3 * ((2 * 16 + 4 * 8 + 4) * 4 + (2 * 2 * 16 + 4 * 8) * 2)
    assert _runner(object(), 3).profile_cudagraph_memory() == 3 * 1000 + 2 * 128 * per_token
    assert _runner(None, 3).profile_cudagraph_memory() == 1000         # graphs off: vLLM's estimate
