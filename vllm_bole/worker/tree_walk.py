"""The walk stage of a Bole step: which path of each verified tree the target accepts, and the tokens it emits.

A greedy request follows the target's argmax down its tree; a sampled one draws at every node and follows the
draw (``spec_decode/tree_sampler.py``); requests with logits processors get each row processed as vLLM would process
the request with that row's path appended. Where early drafting walked the trees on the device already
(``worker/early_drafting.py``), the stage reads that walk: its tokens stay on the device under async scheduling,
else they come to the host. Benchmarks with synthetic acceptance draw the paths from given rates.
"""

import numpy as np
import torch
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.sampler import _SAMPLING_EPS

from ..spec_decode.queued_drafts import PLACEHOLDER
from ..spec_decode.tree_sampler import (SeededDraws, draw_tree_rows, is_plain_greedy, is_plain_random, pad_outputs,
                                        processed_tree_rows, row_depths, sample_tree_rows, tree_rows_supported,
                                        walk_tree)


class TreeWalk:
    """The walk of the model runner ``runner``'s step forest. ``paths``: per batch request, this step's accepted
    nodes (root 0), for the drafter's contexts; None where the host never saw them (device-output steps, steps
    without trees)."""

    def __init__(self, runner):
        self.runner = runner
        self.paths: list[list[int]] | None = None

    def sample(self, logits, spec_decode_metadata, vllm_sample) -> SamplerOutput:
        """The step's sampled tokens (vLLM's ``_sample``): the walk of each tree in the runner's forest, or
        ``vllm_sample(logits, spec_decode_metadata)`` (vLLM's own) for a step without trees."""
        runner = self.runner
        forest = runner._bole_forest
        first = runner._bole_early_draft
        if first is not None and first.walk is not None and first.host is None:
            # Async scheduling: the tokens stay on the device; nothing here waits for the host trees.
            return self._device_output(forest)
        if forest is not None:
            forest.materialize()
        if first is not None and first.walk is not None:
            return self._walked_output(logits, forest)
        if spec_decode_metadata is None or forest is None:
            self.paths = None
            if forest is not None and forest.tree_req_indices:
                # A plain decode step that ran from a graph as one-node trees: each root is accepted, and the
                # commit writes the state after it (graph mode leaves the GDN state to the commit).
                forest.accepted_paths = [[0] for _ in forest.tree_req_indices]
                self.paths = [[0] for _ in runner.input_batch.req_ids]
            return self._on_host(vllm_sample(logits, spec_decode_metadata))
        runner.input_batch.update_async_output_token_ids()
        metadata = runner.input_batch.sampling_metadata
        num_rows = [n + 1 for n in spec_decode_metadata.num_draft_tokens]
        row_start = np.concatenate([[0], np.cumsum(num_rows)[:-1]]).tolist()
        tree_of = {r: i for i, r in enumerate(forest.tree_req_indices)}
        # Emitted-token logprobs are rebuilt from raw logits; other logprob modes verify roots only.
        own_logprobs = runner.model_config.logprobs_mode == "raw_logprobs"
        wants_logprobs = metadata.max_num_logprobs is not None
        walks = own_logprobs or not wants_logprobs
        rows_supported = walks and tree_rows_supported(metadata)
        greedy, drawn = [], []  # batch indices of the tree requests walked by argmax / by samples
        processed = []  # those among them whose rows get vLLM's logits processing (penalties, logit bias, ...)
        for r, req_id in enumerate(runner.input_batch.req_ids):
            params = runner.requests[req_id].sampling_params
            if r not in tree_of or not walks:
                continue
            if is_plain_greedy(params):
                greedy.append(r)
            elif rows_supported and is_plain_random(params):
                drawn.append(r)
            elif rows_supported and runner._walks_tree(req_id):
                processed.append(r)
        targets = {}  # batch index -> the target's token after each of its tree rows
        seeded = SeededDraws()   # seeded requests' generators, rewound to the tokens emitted (after the walk)
        if processed:
            targets |= self._processed_targets(logits, processed, row_start, num_rows, tree_of, metadata, seeded)
        if greedy:
            first = runner._bole_early_draft
            if first is not None:   # already on its way to the host (the drafter's first pass runs behind it)
                argmax = first.wait().tolist()
            else:
                argmax = logits.argmax(dim=-1).tolist()
            targets |= {r: argmax[row_start[r]:row_start[r] + num_rows[r]] for r in greedy}
        if drawn:  # one draw per tree row of every sampled request, in one call
            rows = [row_start[r] + j for r in drawn for j in range(num_rows[r])]
            depths = [d for r in drawn for d in row_depths(forest.parents_of(tree_of[r]))]
            draws = sample_tree_rows(logits[torch.tensor(rows, device=logits.device)],
                                     [r for r in drawn for _ in range(num_rows[r])], metadata,
                                     runner.sampler.use_fp64_gumbel, depths, seeded)
            offsets = np.concatenate([[0], np.cumsum([num_rows[r] for r in drawn])]).tolist()
            targets |= {r: draws[offsets[k]:offsets[k + 1]] for k, r in enumerate(drawn)}
        if runner._bole_synthetic is not None:  # benchmarks: accepted paths from given rates, not the target
            paths = [runner._bole_synthetic.walk(forest.parents_of(tree_of[r])) if r in tree_of else [0]
                     for r in range(len(runner.input_batch.req_ids))]
        else:
            paths = [walk_tree(forest.parents_of(tree_of[r]), forest.tokens[tree_of[r]], targets[r])
                     if r in targets else [0] for r in range(len(runner.input_batch.req_ids))]
        final = None
        if len(greedy) == len(paths) and rows_supported and not (wants_logprobs and not own_logprobs):
            # Every request is a plain greedy tree: its bonus token is the argmax at the walk's last node, which
            # the walk already read (what vLLM's sampler would return for that row, without another sync).
            bonus = [targets[r][path[-1]] for r, path in enumerate(paths)]
        else:
            final_rows = [row_start[r] + path[-1] for r, path in enumerate(paths)]
            final = runner.sampler(logits=logits[torch.tensor(final_rows, device=logits.device)],
                                 sampling_metadata=metadata)
            bonus = final.sampled_token_ids[:, 0].tolist()
        for r in drawn + processed:  # the target at the walk's last node is the bonus token
            bonus[r] = targets[r][paths[r][-1]]
        seeded.rewind(metadata.generators, {r: len(paths[r]) for r in seeded.states})
        outputs = []
        for r, path in enumerate(paths):
            i = tree_of.get(r)
            drafted = [forest.tokens[i][j] for j in path[1:]] if i is not None else []
            outputs.append(drafted + [bonus[r]])
        forest.accepted_paths = [paths[r] for r in forest.tree_req_indices]
        self.paths = paths
        runner.bole_budget.observe(forest)
        if runner.bole_walk_log is not None:
            runner.bole_walk_log.add_step(forest, [outputs[r] for r in forest.tree_req_indices],
                                        runner.bole_forest_builder.trees)
        # On the host: vLLM's bookkeeping then reads it without a copy, which would wait behind the drafter's
        # levels on the stream (width >= 2 keeps it on its spec-decode parsing, which needs no event sync either).
        sampled = self._emitted_tokens(outputs)
        if wants_logprobs and not own_logprobs:
            return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=final.logprobs_tensors)
        return SamplerOutput(sampled_token_ids=sampled,
                             logprobs_tensors=self._path_logprobs(logits, sampled, paths, row_start))

    def _processed_targets(self, logits, reqs: list[int], row_start: list[int], num_rows: list[int], tree_of,
                           metadata, seeded: SeededDraws) -> dict[int, list[int]]:
        """The target's token after each tree row of requests with penalties, bad words, allowed token ids, a
        logit bias or min_tokens (batch indices ``reqs``): each row processed as vLLM would process the request
        with the row's path appended to its output (``tree_sampler.processed_tree_rows``), then its argmax
        (greedy) or one draw (sampled, ``tree_sampler.draw_tree_rows``)."""
        runner = self.runner
        forest = runner._bole_forest
        rows, row_req, row_path = [], [], []
        for r in reqs:
            parents, tokens = forest.parents_of(tree_of[r]), forest.tokens[tree_of[r]]
            paths = [[]]   # per node, the drafted tokens from the root's child down to it
            for j in range(1, len(parents)):
                paths.append(paths[parents[j]] + [tokens[j]])
            rows += range(row_start[r], row_start[r] + num_rows[r])
            row_req += [r] * num_rows[r]
            row_path += paths
        params = [runner.requests[req_id].sampling_params for req_id in runner.input_batch.req_ids]
        rows_t = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
        values = processed_tree_rows(logits[rows_t], row_req, row_path, runner.input_batch.req_output_token_ids,
                                     params, metadata)
        out = values.argmax(dim=-1)   # greedy rows (vLLM's greedy sample of processed logits)
        drawn = [i for i, r in enumerate(row_req) if params[r].temperature >= _SAMPLING_EPS]
        if drawn:
            index = torch.tensor(drawn, dtype=torch.long).to(values.device, non_blocking=True)
            out[index] = draw_tree_rows(values[index], [row_req[i] for i in drawn], metadata,
                                        runner.sampler.use_fp64_gumbel, [len(row_path[i]) for i in drawn],
                                        seeded).to(out.dtype)
        out = out.tolist()
        targets, start = {}, 0
        for r in reqs:
            targets[r] = out[start:start + num_rows[r]]
            start += num_rows[r]
        return targets

    def _emitted_tokens(self, outputs: list[list[int]]) -> torch.Tensor:
        """A host walk's emitted tokens as vLLM's sampled token ids: on the host (its bookkeeping then needs no
        copy), except under async scheduling, where vLLM reads them on the device (its own spec-decode helpers
        too, e.g. when the step's batch does not fit the drafter)."""
        sampled = pad_outputs(outputs, "cpu", min_width=2)
        return sampled.to(self.runner.device) if self.runner.bole_async else sampled

    def _path_logprobs(self, logits, sampled, paths, row_start):
        """Raw logprobs of every emitted token, from the logits row of the node that produced it; laid out
        ``[num_reqs * width]`` like vLLM's rejection sampler (padding rows are filtered out by vLLM)."""
        runner = self.runner
        k = runner.input_batch.sampling_metadata.max_num_logprobs
        if k is None:
            return None
        width = sampled.shape[1]
        rows = [row_start[r] + path[min(m, len(path) - 1)] for r, path in enumerate(paths) for m in range(width)]
        tokens = sampled.flatten().long().clamp(min=0).to(logits.device)
        logprobs = runner.sampler.compute_logprobs(logits[torch.tensor(rows, device=logits.device)].float())
        return runner.sampler.gather_logprobs(logprobs, k, tokens)

    def _on_host(self, output: SamplerOutput) -> SamplerOutput:
        """A step's sampled tokens moved to the host before the drafter is queued (see :meth:`sample`): the copy
        waits only for the target forward. With logprobs vLLM's one-token layout stays as it is; under async
        scheduling the tokens stay on the device."""
        if (output.logprobs_tensors is not None or output.sampled_token_ids.device.type == "cpu"
                or self.runner.bole_async):
            return output
        tokens = output.sampled_token_ids.cpu()
        if tokens.shape[1] == 1:
            tokens = torch.cat([tokens, torch.full_like(tokens, PLACEHOLDER)], dim=1)
        output.sampled_token_ids = tokens
        return output

    def _device_output(self, forest) -> SamplerOutput:
        """The step's tokens from the device walk, left on the device (async scheduling): vLLM's next step reads
        the roots and the corrected counts from there, and its output copy runs behind the step's drafting. The
        commit ran from the device paths already; the host never sees the paths."""
        runner = self.runner
        forest.accepted_paths = None
        self.paths = None
        runner.bole_drafting.host_emitted = {}
        runner.bole_device_output_steps += 1
        if runner.bole_walk_log is not None:   # (the paths stay on the device)
            runner.bole_walk_log.unrecorded_steps += 1
        first = runner._bole_early_draft
        if runner.bole_budget.rule == "throughput":   # the paths reach the acceptance model by a copy
            walk = first.tree_walk
            runner.bole_budget.device_walks.send(walk.rows, walk.length, forest.parent, forest.cu_seqlens)
        return SamplerOutput(sampled_token_ids=first.walk.emitted, logprobs_tensors=None)

    def _walked_output(self, logits, forest) -> SamplerOutput:
        """The step's tokens from the device walk (``early_drafting.launch``): its copy waits for the forward
        and the walk only, not for the drafting queued behind them."""
        runner = self.runner
        first = runner._bole_early_draft
        w = first.walk.rows.shape[1]
        table = first.wait().tolist()   # per batch request: path rows, emitted tokens, path length
        paths = [[0] for _ in table]    # (a prefill chunk's: its last row alone)
        for r, start in zip(forest.tree_req_indices, forest.query_starts):
            row = table[r]
            paths[r] = [x - start for x in row[:row[-1]]]
        outputs = [row[w:w + row[-1]] for row in table]
        forest.accepted_paths = [paths[r] for r in forest.tree_req_indices]
        self.paths = paths
        runner.bole_budget.observe(forest)
        if runner.bole_walk_log is not None:
            runner.bole_walk_log.add_step(forest, [outputs[r] for r in forest.tree_req_indices],
                                        runner.bole_forest_builder.trees)
        sampled = self._emitted_tokens(outputs)
        if runner.input_batch.sampling_metadata.max_num_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=None)
        return SamplerOutput(sampled_token_ids=sampled,
                             logprobs_tensors=self._path_logprobs(logits, sampled, paths, first.logit_starts))
