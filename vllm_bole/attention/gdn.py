"""Bole's Qwen GDN layer: verifies a packed forest of trees from one committed state per request.

Registered over vLLM's ``QwenGatedDeltaNetAttention`` (``PluggableLayer.register_oot``) in Bole's workers only.
Tree requests (vLLM's "spec decodes") run the closed-form tree kernels; prefills and plain decodes run vLLM's
own path unchanged. The state cache keeps one (conv, ssm) slot per request: nothing is written during
verification; :func:`commit_step` writes the accepted path's state after sampling.
"""

import dataclasses
import math

import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator, is_conv_state_dim_first
from vllm.platforms import current_platform
from vllm.utils.math_utils import next_power_of_2
from vllm.utils.torch_utils import async_tensor_h2d
from vllm.v1.kv_cache_interface import MambaSpec

from .. import kernels
from .._vllm_compat import cpu_conv_weight, dispatch_to_forward_cuda
from ..kernels.reference import TreeFactors
from ..step.forest import current_forest


def conv_state_view(layer) -> torch.Tensor:
    """The conv cache as ``[num_slots, dim, W-1]`` (a view)."""
    conv = layer.kv_cache[0]
    return conv if is_conv_state_dim_first() else conv.transpose(-1, -2)


def ssm_state_view(layer) -> torch.Tensor:
    """The SSM cache as ``[num_slots, HV, dv, dk]`` (S transposed, the layout Bole's kernels use).

    vLLM's CPU GDN kernels keep S itself in that memory ([HV, dk, dv]); the GPU kernels keep S transposed.
    """
    ssm = layer.kv_cache[1]
    if current_platform.is_cpu():
        n, h, dv, dk = ssm.shape
        return ssm.view(n, h, dk, dv).transpose(-1, -2)
    return ssm


def gdn_gates(layer, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) as ``[N, HV]`` float32, the values vLLM's GDN gating gives on this platform: its CPU op, or
    on GPUs the same math in one launch that reads the strided projections (``kernels.gdn_gates``)."""
    if current_platform.is_cpu():
        from vllm import _custom_ops as ops

        g, beta = ops.fused_gdn_gating_cpu(A_log=layer.A_log, a=a.contiguous(), b=b.contiguous(),
                                           dt_bias=layer.dt_bias)
        n = a.shape[0]
        return g.reshape(n, -1).float(), beta.reshape(n, -1).float()
    return kernels.gdn_gates(a, b, layer.A_log, layer.dt_bias)


def conv_weight_2d(layer) -> torch.Tensor:
    w = cpu_conv_weight(layer.conv1d)
    if w is None:
        w = layer.conv1d.weight
    return w.view(w.shape[0], w.shape[-1])


class BoleQwenGDN(QwenGatedDeltaNetAttention):
    # GDN layers of the model being served (each worker process builds one model).
    num_layers = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        BoleQwenGDN.num_layers += 1
        # Every platform reaches ``_forward_core`` through vLLM's ``qwen_gdn_attention_core`` op; its input and
        # output projections are the same torch modules the CPU path uses.
        dispatch_to_forward_cuda(self)

    def get_attn_backend(self):
        # vLLM's GDN metadata, built once per step and shared by the GDN KV-cache groups (attention/gdn_metadata.py)
        from .gdn_metadata import BoleGDNAttentionBackend

        return BoleGDNAttentionBackend

    def get_state_shape(self):
        # One state per request: no rolling conv window for drafts (Bole keeps conv inputs as tree factors).
        return MambaStateShapeCalculator.gated_delta_net_state_shape(
            self.tp_size, self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim,
            self.conv_kernel_size, 0)

    def get_kv_cache_spec(self, vllm_config):
        spec = super().get_kv_cache_spec(vllm_config)
        return dataclasses.replace(spec, num_speculative_blocks=0) if isinstance(spec, MambaSpec) else spec

    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        forward_context = get_forward_context()
        attn = forward_context.attn_metadata
        meta = attn.get(self.prefix) if isinstance(attn, dict) else None
        forest = current_forest()
        if forest is not None and forest.graph is not None:
            # Graph mode (worker/verify_graphs.py): every row is a tree node or padding; the slots come from
            # the persistent block table, not from this step's metadata (fresh tensors every step).
            self._verify_trees(mixed_qkv, b, a, forest.graph.state_slots(self.prefix), forest, out=core_attn_out)
            return
        if meta is None or meta.spec_sequence_masks is None or forest is None:
            return self._vllm_core(mixed_qkv, b, a, core_attn_out, meta)

        tree_idx = meta.spec_token_indx
        slots = meta.spec_state_indices_tensor[:, 0]
        checkpoints = getattr(meta, "bole_checkpoints", None)
        if tree_idx is None:  # every token belongs to a tree: no gather or scatter
            n = meta.num_spec_decode_tokens
            self._verify_trees(mixed_qkv[:n], b[:n], a[:n], slots, forest, out=core_attn_out[:n],
                               checkpoints=checkpoints)
        else:
            tree_idx = tree_idx.long()
            core_attn_out.index_copy_(0, tree_idx, self._verify_trees(
                mixed_qkv.index_select(0, tree_idx), b.index_select(0, tree_idx), a.index_select(0, tree_idx),
                slots, forest, checkpoints=checkpoints))

        if meta.num_prefills > 0:
            # The other requests are prefills (vLLM files plain decodes beside spec decodes as prefills).
            rest = meta.non_spec_token_indx.long()
            sub_meta = dataclasses.replace(
                meta, num_spec_decodes=0, num_spec_decode_tokens=0, spec_query_start_loc=None,
                spec_state_indices_tensor=None, spec_sequence_masks=None, spec_token_indx=None,
                non_spec_token_indx=None, num_accepted_tokens=None, num_actual_tokens=meta.num_prefill_tokens)
            sub_out = torch.zeros_like(core_attn_out[: rest.numel()])
            self._vllm_core(mixed_qkv.index_select(0, rest).contiguous(), b.index_select(0, rest),
                            a.index_select(0, rest), sub_out, sub_meta)
            core_attn_out.index_copy_(0, rest, sub_out)

    def _vllm_core(self, mixed_qkv, b, a, core_attn_out, meta):
        """vLLM's own GDN core for requests without a tree, reading ``meta`` as this layer's metadata."""
        if current_platform.is_cpu():
            if meta is None or meta.num_actual_tokens == 0:
                return
            from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import _cpu_gdn_attention_nonspec

            return _cpu_gdn_attention_nonspec(self, meta, mixed_qkv, b, a, core_attn_out)
        attn = get_forward_context().attn_metadata
        if meta is None or not isinstance(attn, dict) or attn.get(self.prefix) is meta:
            return super()._forward_core(mixed_qkv, b, a, core_attn_out)
        original, attn[self.prefix] = attn[self.prefix], meta
        try:
            return super()._forward_core(mixed_qkv, b, a, core_attn_out)
        finally:
            attn[self.prefix] = original

    def _verify_trees(self, x, b, a, state_slots, forest, out=None, checkpoints=None):
        """Outputs of every tree node ``[N, HV, dv]`` (into ``out`` when given); keeps the factors for
        :func:`commit_step`, and with prefix caching the block-boundary slots (``checkpoints``,
        ``gdn_metadata.BlockCheckpoints``). The caches are read in place by slot, the conv kernel keeps the conv
        inputs for the commit, and q, k, v are views of the conv output: in a verification graph every GDN
        layer's copies, gathers and splits are small kernels of their own."""
        scratch = GDNStepScratch.of(forest, self, x)
        layer = scratch.add_layer(self, state_slots, checkpoints)
        return self.tree_kernels(x, b, a, state_slots, forest.parent, forest.cu_seqlens, forest.max_nodes or None,
                                 forest.device_bits(), scratch.conv_inputs[layer], scratch.factors_of(layer), out)

    def tree_kernels(self, x, b, a, state_slots, parent, cu_seqlens, max_nodes, bits, conv_inputs, factors,
                     out=None):
        """The tree kernels of one verification over this layer's caches (read only): conv, gates, GDN. Serving
        runs them through :meth:`_verify_trees`; the start-up warm-up (``worker/kernel_warmup.py``) on dummy
        forests of every launch variant."""
        y = kernels.tree_causal_conv1d(x, conv_weight_2d(self), self.conv1d.bias, conv_state_view(self), parent,
                                       cu_seqlens, activation=self.activation, state_indices=state_slots,
                                       x_copy=conv_inputs)
        q, k, v = self._split_qkv(y)
        g, beta = gdn_gates(self, a, b)
        o, _ = kernels.tree_gdn_verify(
            q, k, v, g, beta, ssm_state_view(self), parent, cu_seqlens, use_qk_l2norm_in_kernel=True,
            state_indices=state_slots, out_factors=factors, max_seqlen=max_nodes, bits=bits, out=out)
        return o

    def _split_qkv(self, y: torch.Tensor):
        """q, k ``[N, HK, dk]`` and v ``[N, HV, dv]`` as views of the conv output ``[N, conv_dim]`` (the tree
        kernels take any row stride; vLLM's ``rearrange_mixed_qkv`` copies them out)."""
        n, kd = y.shape[0], self.key_dim // self.tp_size
        return (y[:, :kd].view(n, -1, self.head_k_dim), y[:, kd:2 * kd].view(n, -1, self.head_k_dim),
                y[:, 2 * kd:].view(n, -1, self.head_v_dim))


class GDNStepScratch:
    """What a verification step's GDN layers leave for the commit, stacked over layers so that one call
    commits them all without copying: factors ``[L, N, ...]``, conv inputs ``[L, N, conv_dim]`` and each
    layer's state slots. Allocated by the step's first GDN layer (every Bole GDN layer of the model runs in
    each step; L is their count)."""

    def __init__(self, n_layers: int, layer, x: torch.Tensor, rows: int | None = None):
        n, dev = x.shape[0] if rows is None else rows, x.device
        hk, hv = layer.num_k_heads // layer.tp_size, layer.num_v_heads // layer.tp_size
        self.layers: list = []
        self.slots: list[torch.Tensor] = []
        self.checkpoints: list = []   # per layer, its group's BlockCheckpoints (prefix caching) or None
        self.factors = TreeFactors(
            k=torch.empty(n_layers, n, hk, layer.head_k_dim, dtype=torch.float32, device=dev),
            u=torch.empty(n_layers, n, hv, layer.head_v_dim, dtype=torch.float32, device=dev),
            g_cum=torch.empty(n_layers, n, hv, dtype=torch.float32, device=dev))
        self.conv_inputs = torch.empty(n_layers, n, x.shape[1], dtype=x.dtype, device=dev)

    @classmethod
    def of(cls, forest, layer, x: torch.Tensor) -> "GDNStepScratch":
        if forest.gdn_scratch is None:
            graph = forest.graph
            if graph is None:
                forest.gdn_scratch = cls(BoleQwenGDN.num_layers, layer, x)
            else:  # graph mode: one allocation per power-of-two row capacity, shared by the graphs within it
                capacity = next_power_of_2(x.shape[0])
                if capacity not in graph.scratch_storage:
                    graph.scratch_storage[capacity] = cls(BoleQwenGDN.num_layers, layer, x, rows=capacity)
                forest.gdn_scratch = graph.scratch_storage[capacity].rows_view(x.shape[0])
        return forest.gdn_scratch

    def rows_view(self, n: int) -> "GDNStepScratch":
        """A scratch of ``n`` rows in this one's memory (contiguous ``[L, n, ...]`` views; the graphs that
        share it never run at the same time)."""
        view = object.__new__(GDNStepScratch)
        view.layers, view.slots, view.checkpoints = [], [], []

        def first_rows(t):
            return t.view(-1)[:t.shape[0] * n * math.prod(t.shape[2:])].view(t.shape[0], n, *t.shape[2:])

        f = self.factors
        view.factors = TreeFactors(k=first_rows(f.k), u=first_rows(f.u), g_cum=first_rows(f.g_cum))
        view.conv_inputs = first_rows(self.conv_inputs)
        return view

    def add_layer(self, layer, state_slots: torch.Tensor, checkpoints=None) -> int:
        self.layers.append(layer)
        self.slots.append(state_slots)
        self.checkpoints.append(checkpoints)
        return len(self.layers) - 1

    def factors_of(self, i: int) -> TreeFactors:
        return TreeFactors(k=self.factors.k[i], u=self.factors.u[i], g_cum=self.factors.g_cum[i])

    def reset(self) -> None:
        """Forget the layers of an earlier forward (the buffers are reused by a graph's capture)."""
        self.layers.clear()
        self.slots.clear()
        self.checkpoints.clear()

    def used(self) -> tuple[TreeFactors, torch.Tensor]:
        """Factors and conv inputs of the layers that ran (all of them in a full forward)."""
        n = len(self.layers)
        f = self.factors
        return TreeFactors(k=f.k[:n], u=f.u[:n], g_cum=f.g_cum[:n]), self.conv_inputs[:n]


def commit_step(forest) -> None:
    """Write the accepted path's GDN state and conv window into every GDN layer's single slot: one batched
    call each for all layers (layers of different KV-cache groups have their own slot per request)."""
    scratch = forest.gdn_scratch
    if scratch is None or not scratch.layers:
        return
    slots = torch.stack(scratch.slots).to(torch.int32).contiguous()       # [L, B]
    if forest.accepted_device is not None:   # the device walk's (the host may not know the paths yet)
        accepted = forest.accepted_device.to(torch.int32)
    else:   # pinned: the commit is queued after the drafter's levels, and its host work should not wait for them
        accepted = async_tensor_h2d(forest.accepted, slots.device, torch.int32)
    factors, conv_inputs = scratch.used()
    views = [_cache_views(layer) for layer in scratch.layers]
    if scratch.checkpoints and scratch.checkpoints[0] is not None:
        _commit_block_boundaries(forest, scratch, slots, views, factors, conv_inputs)
    kernels.commit_accepted_inplace([v[0] for v in views], slots, factors, accepted, forest.parent, forest.cu_seqlens)
    kernels.commit_conv_state_inplace([v[1] for v in views], slots, conv_inputs, forest.parent, forest.cu_seqlens,
                                      accepted)
    forest.gdn_scratch = None


def _commit_block_boundaries(forest, scratch, slots, views, factors, conv_inputs) -> None:
    """Prefix caching: the GDN state and conv window at the block boundary each accepted path reaches, written
    into that boundary's block (``gdn_metadata.BlockCheckpoints``), before the running slot gets the whole path.
    The boundary's block starts as a copy of the running slot's state from before the step, then commits the
    path up to the boundary. Rows whose block is vLLM's null block (0) copy and commit nothing. The checkpoints
    cover the forest's requests (a verification graph's: ``verify_graphs.step_checkpoints``)."""
    lengths = scratch.checkpoints[0].path_lengths
    slots = slots[:, :len(lengths)]   # (a graph's slots cover its padded requests too)
    dev = slots.device
    if forest.accepted_device is None:   # the host walk's paths
        rows = [b for b, path in enumerate(forest.accepted_paths) if 0 < lengths[b] <= len(path)]
        nodes = torch.full((len(lengths),), -1, dtype=torch.int32)
        for b in rows:
            nodes[b] = forest.accepted_paths[b][lengths[b] - 1]
        nodes = nodes.to(dev)
    else:   # the device walk's: every row with a boundary in reach copies, and commits if its path reaches it
        rows = [b for b, n in enumerate(lengths) if 0 < n]
        nodes = _device_boundary_nodes(forest, lengths, dev) if rows else None
    if not rows:
        return
    targets = torch.stack([c.slots for c in scratch.checkpoints]).to(dev)                 # [L, B]
    real = targets > 0
    # a request's boundary block is null in every KV-cache group or in none; a null one is left alone
    nodes = torch.where(real.all(dim=0), nodes, -1)
    dst = torch.where(real, targets, slots)                                                  # [L, B]
    picked = torch.tensor(rows, device=dev)
    for (ssm, conv), src_l, dst_l in zip(views, slots, dst):
        src_i, dst_i = src_l[picked].long(), dst_l[picked].long()
        ssm[dst_i] = ssm[src_i]
        conv[dst_i] = conv[src_i]
    kernels.commit_accepted_inplace([v[0] for v in views], dst, factors, nodes, forest.parent, forest.cu_seqlens)
    kernels.commit_conv_state_inplace([v[1] for v in views], dst, conv_inputs, forest.parent, forest.cu_seqlens, nodes)


def _device_boundary_nodes(forest, lengths: list[int], device) -> torch.Tensor:
    """Per tree request, the local node at path length ``lengths[b]`` (root first) of the device walk's accepted
    path, -1 where the path is shorter or the length is 0; without waiting for the walk. A row whose path falls
    short has copied the running state into its boundary's block and commits nothing there: that block is published
    only once the computed tokens pass the boundary, so a later step's path writes it first."""
    want = torch.tensor(lengths, dtype=torch.long).to(device, non_blocking=True)
    starts = torch.tensor(forest.query_starts, dtype=torch.long).to(device, non_blocking=True)
    path = forest.accepted_rows_device                                     # [B, W] flat rows, -1 past the path
    col = (want - 1).clamp(0, path.shape[1] - 1)
    flat = path.gather(1, col[:, None]).squeeze(1)
    reach = (want > 0) & (want <= path.shape[1]) & (flat >= 0)
    return torch.where(reach, flat - starts, -1).to(torch.int32)


def _cache_views(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """(:func:`ssm_state_view`, :func:`conv_state_view`) of a layer, kept on it while its caches stay the same
    tensors (every step commits every layer: the views are made once)."""
    cached = getattr(layer, "_bole_cache_views", None)
    conv, ssm = layer.kv_cache[0], layer.kv_cache[1]
    if cached is None or cached[2] is not conv or cached[3] is not ssm:
        cached = layer._bole_cache_views = (ssm_state_view(layer), conv_state_view(layer), conv, ssm)
    return cached[0], cached[1]
