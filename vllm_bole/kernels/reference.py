"""Torch references of every Bole kernel, with the same signatures as :mod:`vllm_bole.kernels`.

These are the CPU path and the ground truth the Triton kernels are tested against.
"""

from .tree_conv1d.reference import commit_conv_state, commit_conv_state_inplace, tree_causal_conv1d
from .tree_gdn.reference import TreeFactors, commit_accepted, commit_accepted_inplace, gdn_gates, tree_gdn_verify

__all__ = [
    "TreeFactors", "commit_accepted", "commit_accepted_inplace", "commit_conv_state", "commit_conv_state_inplace",
    "gdn_gates", "tree_causal_conv1d", "tree_gdn_verify",
]
