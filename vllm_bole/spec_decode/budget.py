"""Per-step node budget: how many tree nodes one verification step carries over the whole batch."""

import functools

from vllm.logger import init_logger

logger = init_logger(__name__)

# Used by budget="auto" until a calibrated table for this GPU and model exists.
DEFAULT_AUTO_BUDGET = 128


@functools.cache
def _warn_default_once() -> None:
    logger.info("Bole budget 'auto': no calibration table loaded; using %d nodes per step", DEFAULT_AUTO_BUDGET)


def node_budget(bole_config, batch_size: int) -> int:
    if bole_config.budget != "auto":
        return int(bole_config.budget)
    _warn_default_once()
    return DEFAULT_AUTO_BUDGET
