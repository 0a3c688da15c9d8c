"""Running Bole's Triton kernels in tests: compiled on a CUDA machine, under Triton's interpreter otherwise."""

import contextlib
import importlib
import os

import torch

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"


@contextlib.contextmanager
def interpreter():
    """Set ``TRITON_INTERPRET=1`` for the block on machines without a GPU."""
    if GPU:
        yield
        return
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


def import_kernel_modules(*names: str) -> list:
    """Import kernel modules; without a GPU make sure their kernels were built for the interpreter (a module
    imported earlier in the session without it is reloaded)."""
    with interpreter():
        from triton.runtime.interpreter import InterpretedFunction

        mods = [importlib.import_module(n) for n in names]
        if not GPU:
            mods = [m if isinstance(m.__dict__[k], InterpretedFunction) else importlib.reload(m)
                    for m in mods for k in [next(k for k in vars(m) if k.endswith("_kernel"))]]
    return mods
