"""vLLM's own GDN Triton kernels (its vendored FLA ops), to compare and time Bole's kernels against.

The files are vLLM 0.26's ``third_party/flash_linear_attention/ops/{fused_recurrent,fused_sigmoid_gating}.py``,
read from the folder named by ``BOLE_VLLM_FLA_DIR`` (copies, for a GPU machine without vLLM) or else from the
installed vLLM. They use nothing of vLLM but its Triton re-export and FLA's ``exp`` alias, so with those
imports pointed at Triton they load standalone (also where vLLM's CPU build stubs Triton out).
"""

import importlib
import importlib.util
import re
from pathlib import Path

from vllm_bole import envs

_CACHE = Path(__file__).parent / ".cache" / "vllm_fla"
_IMPORTS = {
    "from vllm.triton_utils import tl, triton": "import triton\nimport triton.language as tl",
    "from .op import exp": "",
}


def _source_dir():
    folder = envs.BOLE_VLLM_FLA_DIR
    if folder:
        return Path(folder)
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(spec.submodule_search_locations[0]) / "third_party" / "flash_linear_attention" / "ops"


def load(name: str):
    """The module ``name`` ("fused_recurrent" or "fused_sigmoid_gating"), or None when unavailable."""
    folder = _source_dir()
    if folder is None or not (folder / f"{name}.py").is_file():
        return None
    text = (folder / f"{name}.py").read_text()
    for old, new in _IMPORTS.items():
        text = text.replace(old, new)
    # FLA's exp alias is tl.exp (FLA_USE_FAST_OPS unset); spelled out, the Triton interpreter runs it too.
    text = re.sub(r"(?<![\w.])exp\(", "tl.exp(", text)
    if "from vllm" in text or "from ." in text:
        return None
    # Triton reads kernel source back from the file, so the patched copy must live on disk.
    _CACHE.mkdir(parents=True, exist_ok=True)
    path = _CACHE / f"{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"_vllm_fla_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
