"""Bole's loggers print through vLLM's logging setup (same handler, format and ``VLLM_LOGGING_LEVEL``).

vLLM configures only its own ``vllm`` logger; a plugin's ``vllm_bole.*`` loggers would otherwise fall back to
Python's last-resort handler, which drops INFO lines.
"""

import logging

from vllm.logger import init_logger as _vllm_init_logger

_ROOT = "vllm_bole"


def init_logger(name: str) -> logging.Logger:
    root = logging.getLogger(_ROOT)
    if not root.handlers:
        vllm_root = _vllm_init_logger("vllm")
        for handler in vllm_root.handlers:
            root.addHandler(handler)
        root.setLevel(vllm_root.level)
        root.propagate = False
    return logging.getLogger(name)
