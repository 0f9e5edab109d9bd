#!/usr/bin/env bash
# Creates .venv-sglang/ at the repository root: the real SGLang 0.5.23 server and sglang-router
# 0.3.2 on a CPU machine, for tests/real_sglang (see README.md there). Idempotent: rerunning
# reinstalls nothing that is already at its pinned version. Run it as `make sglang-env`.
#
# Lean on purpose: torch 2.13.0 is the CPU build (any other torch request pulls a multi-GB
# CUDA build), and sglang, sglang-router and every package of requirements.txt are installed
# with --no-deps (sglang's metadata asks for CUDA torch 2.14.1, flashinfer and NVIDIA libraries).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
VENV=.venv-sglang
PYTHON=${PYTHON:-python3}
start=$(date +%s)

rm -f "$VENV/.installed"
"$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip --disable-pip-version-check --no-input -qq)
"${pip[@]}" install --no-deps -c constraints-cpu.txt torch==2.13.0
"${pip[@]}" install --no-deps sglang==0.5.23 sglang-router==0.3.2
"${pip[@]}" install --no-deps -c constraints-cpu.txt -r tests/real_sglang/requirements.txt

# triton is imported by sglang but never compiles a kernel on CPU: drop its bundled CUDA/ROCm
# compilers and profiler libraries (~460 MB of its ~1 GB; `import triton` does not need them).
triton_dir=$("$VENV/bin/python" -c 'import os, importlib.util as u; print(os.path.dirname(u.find_spec("triton").origin))')
rm -rf "$triton_dir/backends/nvidia/bin" "$triton_dir/backends/nvidia/lib" "$triton_dir/backends/amd/lib"

touch "$VENV/.installed"
echo "install.sh: $VENV ready in $(($(date +%s) - start)) s, $(du -sh "$VENV" | cut -f1)"
