"""The MTP tree drafter, logging the positions of every MTP forward's rows (``drafter_args``: ``{"log": path}``):
one JSON line per forward with the rows' token positions, the three M-RoPE positions written for them, and the
batch's requests (id, prompt length, M-RoPE text offset). Tests of the drafter's positions on image prompts."""

import json

from .._vllm_compat import drafter_positions
from ..spec_decode.mtp_tree_drafter import MTPTreeDrafter


class RopeRecordingDrafter(MTPTreeDrafter):
    def __init__(self, runner, bole_config):
        super().__init__(runner, bole_config)
        self.log = bole_config.drafter_args["log"]

    def _write_arrays(self, tokens, positions, slots, hidden, rope=None):
        written = super()._write_arrays(tokens, positions, slots, hidden, rope)
        n = hidden.shape[0]
        plain = positions.tolist() if hasattr(positions, "tolist") else list(positions)
        runner = self.runner
        batch = [[r, len(runner.requests[r].prompt_token_ids), runner.requests[r].mrope_position_delta or 0]
                 for r in runner.input_batch.req_ids]
        with open(self.log, "a") as f:
            f.write(json.dumps({"positions": [int(p) for p in plain[:n]],
                                "rope": drafter_positions(self.proposer, n).tolist(), "batch": batch}) + "\n")
        return written
