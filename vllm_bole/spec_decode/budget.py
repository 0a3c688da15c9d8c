"""Per-step node budget: how many tree nodes one verification step carries over the whole batch.

``budget`` is an int, or ``"auto"``: the calibrated B_ver for this model, GPU, batch size and (when the caller
knows it) context length, read once per process from the table written by ``vllm-bole calibrate`` (path:
``budget_table`` in the speculative config, else ``$VLLM_BOLE_BUDGET_TABLE``, else
``~/.cache/vllm-bole/budget_table.json``; see :mod:`vllm_bole.calibration.table`). Without a usable table it
logs one warning saying why and uses :data:`DEFAULT_AUTO_BUDGET`.
"""

import functools
from pathlib import Path

from ..logger import init_logger

from ..calibration.table import default_table_path, device_name, model_fingerprint, read_table, select_model

logger = init_logger(__name__)

# Nodes per step for budget="auto" when no calibration table applies (the A100 peak in the Bole paper).
DEFAULT_AUTO_BUDGET = 128


def table_path(bole_config) -> Path:
    return Path(bole_config.budget_table) if bole_config.budget_table else default_table_path()


@functools.cache
def _auto_budgets(path: Path, fingerprint: str | None):
    """The table's budgets for this GPU and model, or None (after one warning)."""
    try:
        entries = read_table(path)
    except FileNotFoundError:
        reason = f"no calibration table at {path} (write one with `vllm-bole calibrate`)"
    except (OSError, ValueError) as e:
        reason = f"unreadable calibration table ({e})"
    else:
        budgets, reason = select_model(entries, device_name(), fingerprint)
        if budgets is not None:
            logger.info("Bole budget 'auto': %s for %s on %s, batch sizes %s", path, budgets.fingerprint,
                        budgets.gpu, budgets.batch_sizes)
            return budgets
        reason = f"{path}: {reason}"
    logger.warning("Bole budget 'auto': %s; using %d nodes per step", reason, DEFAULT_AUTO_BUDGET)
    return None


def reload_budget_tables() -> None:
    """Forget the tables read so far (after writing one in this process)."""
    _auto_budgets.cache_clear()


def node_budget(bole_config, batch_size: int, context_len: int | None = None, model_config=None) -> int:
    """Nodes to verify this step. ``context_len``: the batch's mean context length, if known (picks the KV
    bucket); ``model_config``: vLLM's ModelConfig (picks the model; without it, the only model calibrated on
    this GPU)."""
    if bole_config.budget != "auto":
        return int(bole_config.budget)
    fingerprint = model_fingerprint(model_config) if model_config is not None else None
    budgets = _auto_budgets(table_path(bole_config), fingerprint)
    if budgets is None:
        return DEFAULT_AUTO_BUDGET
    return budgets.lookup(batch_size, context_len)
