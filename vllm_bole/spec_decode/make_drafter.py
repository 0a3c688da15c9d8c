"""The tree drafter a speculative config names: ``"mtp"``, the model's own MTP head, or ``"module.path:ClassName"``
of a :class:`~vllm_bole.spec_decode.drafter.TreeDrafter` subclass."""

import importlib

from .drafter import TreeDrafter
from .mtp_tree_drafter import MTPTreeDrafter


def make_drafter(runner, bole_config) -> TreeDrafter:
    if bole_config.drafter == "mtp":
        return MTPTreeDrafter(runner, bole_config)
    module, _, name = bole_config.drafter.partition(":")
    cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, TreeDrafter)):
        raise TypeError(f"speculative_config.drafter {bole_config.drafter!r} is not a TreeDrafter subclass")
    return cls(runner, bole_config)
