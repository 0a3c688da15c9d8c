"""The first stage of a Bole step: the verification forest of the drafts vLLM scheduled.

Each request with scheduled drafts gets its verification tree (node 0 the last sampled token): the tree the
drafter proposed for it last step, the drafter's selection still on the device where vLLM holds placeholders
(``selection: "per_request"`` and async scheduling: ``spec_decode/queued_drafts.py``), or a chain of drafts Bole
did not propose. Draft rows' RoPE positions become prefix + depth in the runner's input buffers. Plain decodes
become one-node trees where a verification graph runs the step. The forest reaches the layers through
``step.forest.set_current_forest`` (docs/design.md, "One step").
"""

import functools

import numpy as np
import torch
from vllm.utils.torch_utils import async_tensor_h2d

from ..spec_decode.device_beam import device_constant
from ..spec_decode.queued_drafts import PLACEHOLDER
from ..spec_decode.tree import DraftTree
from ..step.forest import StepForest


class ForestBuilder:
    """Builds each step's :class:`StepForest` for the model runner ``runner`` (its input batch and input buffers)
    from the drafts awaiting verification: ``trees``, the last proposal's trees by request, and ``queued``, drafts
    vLLM took as placeholders, ``(QueuedDrafts, finish, the drafting step's request ids)``, which serve only the
    step right after the one that drafted them. Counts: ``queued_trees``, trees verified from queued drafts (their
    nodes read on the device); ``stale_placeholders``, placeholder drafts whose queued trees were gone (verified as
    a chain)."""

    def __init__(self, runner):
        self.runner = runner
        self.trees: dict[str, DraftTree] = {}
        self.queued = None
        self.queued_trees = 0
        self.stale_placeholders = 0

    def build(self, scheduler_output, num_scheduled_tokens: np.ndarray) -> StepForest:
        """The step's forest: a tree per request with scheduled drafts (its drafts are the last proposal's tree,
        the queued drafts' on the device, or a chain), and RoPE positions of the runner's input rows rewritten to
        prefix + depth."""
        runner = self.runner
        req_ids = runner.input_batch.req_ids
        starts = np.concatenate([[0], np.cumsum(num_scheduled_tokens)[:-1]])
        queued, self.queued = self.queued, None
        forest_req, tree_parents, tokens, q_starts = [], [], [], []
        fix_rows, fix_shift = [], []  # flat rows whose position is prefix + depth, not prefix + index
        depth_bound = 0   # no node deeper: queued trees grow at most max_depth levels
        plain = []  # (batch index, first row) of decodes without drafts: one-node trees if a graph runs
        from_device = []  # (tree index, batch index, drafts) of trees whose nodes come from the queued drafts
        stale = []        # tree indices of placeholder drafts without queued ones: chains whose tokens go up
        decoding = runner.input_batch.num_computed_tokens_cpu >= runner.input_batch.num_prompt_tokens
        for r, req_id in enumerate(req_ids):
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if drafts is None or num_scheduled_tokens[r] != len(drafts) + 1:
                if not drafts and num_scheduled_tokens[r] == 1 and decoding[r]:
                    plain.append((r, int(starts[r])))
                continue
            if drafts[0] == PLACEHOLDER and queued is not None and len(drafts) <= queued[0].count(req_id):
                from_device.append((len(forest_req), r, len(drafts)))
                depth_bound = max(depth_bound, min(len(drafts), runner.bole_config.max_depth))
                forest_req.append(r)
                tree_parents.append(None)
                tokens.append(None)
                q_starts.append(int(starts[r]))
                continue
            tree = self.trees.get(req_id)
            if drafts[0] == PLACEHOLDER:
                # Placeholders without queued drafts (the request was not scheduled in the step after its drafts):
                # a chain of token 0, written below; the walk checks it like any draft.
                tree = DraftTree([0] * len(drafts), list(range(-1, len(drafts) - 1)), [1.0] * len(drafts))
                stale.append(len(forest_req))
                self.stale_placeholders += 1
            elif tree is None or tree.tokens[:len(drafts)] != list(drafts):
                # Drafts Bole did not propose (e.g. vLLM's placeholders): verify them as a chain.
                tree = DraftTree(list(drafts), list(range(-1, len(drafts) - 1)), [1.0] * len(drafts))
            tree = tree.truncated(len(drafts))
            depths = [0] + tree.depths()
            depth_bound = max(depth_bound, max(depths))
            forest_req.append(r)
            tree_parents.append(tree.verify_parents())
            tokens.append([-1] + tree.tokens)
            q_starts.append(int(starts[r]))
            for j, d in enumerate(depths):
                if j != d:
                    fix_rows.append(int(starts[r]) + j)
                    fix_shift.append(j - d)
        sizes = [int(num_scheduled_tokens[r]) for r in forest_req]
        cu = np.cumsum([0] + sizes).tolist()
        n = cu[-1]
        if from_device or stale:
            self.queued_trees += len(from_device)
            parent = self._write_queued(queued, from_device, stale, tree_parents, tokens, q_starts, cu)
        else:
            parent = [p for par in tree_parents for p in par]
        if runner._bole_graphs is not None:  # the fixed addresses a verification graph reads
            parent, cu_seqlens = runner._bole_graphs.forest_tensors(parent, cu)
        elif isinstance(parent, torch.Tensor):
            parent, cu_seqlens = parent, torch.tensor(cu, dtype=torch.int32).to(runner.device, non_blocking=True)
        else:
            # One host-to-device copy for parents and offsets; non-blocking, so the GPU queue is not drained.
            flat = torch.tensor(parent + cu, dtype=torch.int32).to(runner.device, non_blocking=True)
            parent, cu_seqlens = flat[:n], flat[n:]
        seq_lens = runner.input_batch.num_computed_tokens_cpu[:len(req_ids)] + num_scheduled_tokens[:len(req_ids)]
        forest = StepForest(
            req_ids=[req_ids[r] for r in forest_req], tree_req_indices=forest_req,
            parent=parent, cu_seqlens=cu_seqlens, tokens=tokens, tree_parents=tree_parents,
            max_nodes=max(sizes, default=0), sizes=sizes, query_starts=q_starts,
            tree_only=(len(forest_req) + len(plain) == len(req_ids)
                       and n + len(plain) == int(num_scheduled_tokens.sum())),
            max_seq_len=int(seq_lens.max()) if len(req_ids) else 0,
            computed_cpu=runner.input_batch.num_computed_tokens_cpu_tensor,
            plain_decodes=[(r, req_ids[r], row) for r, row in plain], attention_rows=None,
            depth_bound=depth_bound)
        if any(p is None for p in tree_parents):
            forest.on_host = functools.partial(self.read_queued_trees, queued, from_device)
        if fix_rows:
            rows = torch.tensor(fix_rows, dtype=torch.long).to(runner.device, non_blocking=True)
            shift = torch.tensor(fix_shift, dtype=torch.int64).to(runner.device, non_blocking=True)
            runner.positions[rows] -= shift
            if runner.uses_mrope:
                runner.mrope_positions.gpu[:, rows] -= shift
        return forest

    def _write_queued(self, queued, from_device, stale, tree_parents, tokens, q_starts, cu) -> torch.Tensor:
        """The step's inputs of trees whose drafts vLLM holds as placeholders, on the device: each draft row's
        token and its RoPE position (prefix + depth), and the forest's parents (``[N]`` int32; host trees' from
        ``tree_parents``). ``from_device``: (tree index, batch index, drafts) of trees read from ``queued``;
        ``stale``: tree indices of host chains whose tokens (in ``tokens``) replace the placeholders."""
        runner = self.runner
        rows, nodes, g_idx, j_idx = [], [], [], []
        for i, r, count in from_device:
            first = q_starts[i] + 1
            g = queued[0].row_of[runner.input_batch.req_ids[r]]
            rows += range(first, first + count)
            nodes += range(cu[i] + 1, cu[i] + 1 + count)
            g_idx += [g] * count
            j_idx += range(count)
        host_rows = [q_starts[i] + 1 + j for i in stale for j in range(len(tokens[i]) - 1)]
        host_tokens = [t for i in stale for t in tokens[i][1:]]
        n = cu[-1]
        host_par = [(cu[i] + j, p) for i, par in enumerate(tree_parents) if par is not None
                    for j, p in enumerate(par)]
        device = runner.device
        parent = torch.full((n,), -1, dtype=torch.int32, device=device)
        # pinned, non-blocking: the copies do not wait for the drafter still running (none when empty: under
        # async scheduling every tree is usually a queued one)
        if host_rows:
            host = async_tensor_h2d([host_rows, host_tokens], device, torch.long)
            runner.input_ids.gpu[host[0]] = host[1].to(runner.input_ids.gpu.dtype)
        if host_par:
            pairs = async_tensor_h2d(torch.tensor(host_par, dtype=torch.long).T.contiguous(), device)
            parent[pairs[0]] = pairs[1].to(torch.int32)
        if rows:
            # the same rows every step at a fixed step shape (async scheduling): one copy, kept
            index = device_constant((*rows, *nodes, *g_idx, *j_idx), device).view(4, -1)
            drafts = queued[0]
            g, j = index[2], index[3]
            runner.input_ids.gpu[index[0]] = drafts.tokens[g, j].to(runner.input_ids.gpu.dtype)
            shift = j + 1 - drafts.depths[g, j]
            runner.positions[index[0]] -= shift
            if runner.uses_mrope:
                runner.mrope_positions.gpu[:, index[0]] -= shift
            parent[index[1]] = (drafts.parents[g, j] + 1).to(torch.int32)   # verification tree: root = node 0
        return parent

    def read_queued_trees(self, queued, from_device, forest: StepForest) -> None:
        """The host copy of the trees taken from queued drafts (``StepForest.on_host``): waits for the drafter's
        selection (done by the time the step is walked)."""
        drafts, finish, step_req_ids = queued
        trees = dict(zip(step_req_ids, finish()))   # finish(): one tree per request of the drafting step
        self.trees = trees
        req_ids = self.runner.input_batch.req_ids
        for i, r, count in from_device:
            tree = trees[req_ids[r]]
            if len(tree) < count:
                raise RuntimeError(f"Bole's queued drafts of request {req_ids[r]} hold "
                                   f"{len(tree)} nodes, the step scheduled {count}")
            tree = tree.truncated(count)
            forest.tokens[i] = [-1] + tree.tokens
            forest.tree_parents[i] = tree.verify_parents()
