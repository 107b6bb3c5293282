#!/usr/bin/env bash
# The DeepSeek-R1 recipe end to end on the built-in arithmetic task, on CPU (docs/pipeline.md):
#
#   1. cold-start SFT on answers of the sloppy teacher (tools/make_quickstart_model.py's teacher_answer)
#   2. reasoning RL: GRPO with the rule-based exact-answer reward
#   3. rejection sampling from the stage-2 policy (right answers only) and SFT of the stage-1 model on them
#   4. second RL stage: GRPO with exact_answer + a tiny trained reward model (weights in the YAML), curriculum on
#   5. distillation into a smaller student: a tiny Llama a quarter of the size, cold-started by stage 1's SFT on the
#      same answers, then taught by stage 4's model token by token (on-policy distillation, model.teacher)
#
# Each stage starts from the previous stage's Hugging Face folder (grpo_lightning.callbacks.SaveHFModel), validates on
# the 500 held-out prompts at its end, and the held-out greedy accuracy is printed after it. Everything is written
# under runs/pipeline/ (the paths in configs/pipeline/*.yaml), which is emptied first.
#
#   bash tools/run_pipeline.sh                 # PYTHON=... to choose the interpreter
#   COLD_START_ROWS=20000 RS_PROMPTS=2000 bash tools/run_pipeline.sh
#
# The base model of stage 1 is the shipped tiny-arith (itself the result of a longer cold start on the same teacher,
# tools/make_quickstart_model.py). BASE=null starts from a random tiny Llama instead; it then needs about 40×
# more cold-start data (COLD_START_ROWS=768000, as make_quickstart_model.py uses) to add at all.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
RUN=runs/pipeline
BASE=${BASE:-grpo_lightning/assets/tiny-arith}  # the model stage 1 starts from
COLD_START_ROWS=${COLD_START_ROWS:-19000}       # sloppy-teacher answers for stage 1 (two per training prompt)
RS_PROMPTS=${RS_PROMPTS:-2000}                  # training prompts rejection-sampled in stage 3
RS_K=${RS_K:-8}                                 # samples per prompt
RM_STEPS=${RM_STEPS:-200}                       # reward-model training steps (before stage 4)
export WANDB_MODE=${WANDB_MODE:-offline} TOKENIZERS_PARALLELISM=false

rm -rf "$RUN"
mkdir -p "$RUN/1_cold_start_sft" "$RUN/3_rejection_sft"
TABLE="$RUN/table.md"
printf '| stage | held-out accuracy (500 prompts, greedy) | parameters | wall time |\n|---|---|---|---|\n' >"$TABLE"
PIPELINE_START=$SECONDS

# The last val/accuracy a stage's CSV log holds (validation runs at the end of each stage's fit).
accuracy() {
    "$PYTHON" - "$1/logs/metrics.csv" <<'EOF'
import csv, sys
rows = [r for r in csv.DictReader(open(sys.argv[1])) if r.get("val/accuracy")]
print(f"{100 * float(rows[-1]['val/accuracy']):.1f}%")
EOF
}

# The parameters of the model a stage hands on (its Hugging Face folder's weights; tied embeddings counted once).
parameters() {
    "$PYTHON" - "$1/model.safetensors" <<'EOF'
import sys
from safetensors import safe_open
with safe_open(sys.argv[1], "pt") as weights:
    count = sum(weights.get_tensor(name).numel() for name in weights.keys())
print(f"{count / 1000:.0f} K")
EOF
}

# report <stage label> <stage folder> <start second>
report() {
    local seconds=$((SECONDS - $3)) acc params
    acc=$(accuracy "$2")
    params=$(parameters "$2/hf")
    printf '| %s | %s | %s | %d s |\n' "$1" "$acc" "$params" "$seconds" >>"$TABLE"
    printf '\n==> %s: held-out accuracy %s, %s parameters (%d s)\n\n' "$1" "$acc" "$params" "$seconds"
}

# ---- stage 1: cold-start SFT on the sloppy teacher's answers (training prompts only)
start=$SECONDS
"$PYTHON" - "$RUN/1_cold_start_sft/teacher.jsonl" "$COLD_START_ROWS" <<'EOF'
import json, random, sys

sys.path.insert(0, "tools")
from make_quickstart_model import teacher_answer  # the quickstart's teacher: drops the carry 70% of the time

from grpo_lightning.tasks.arithmetic import addition_pairs, format_prompt

path, rows = sys.argv[1], int(sys.argv[2])
rng, pairs = random.Random(0), addition_pairs()["train"]
with open(path, "w") as f:
    for i in range(rows):
        a, b = pairs[i % len(pairs)]
        f.write(json.dumps({"prompt": format_prompt(a, b), "response": str(teacher_answer(a, b, 0.7, rng))}) + "\n")
print(f"wrote {rows} sloppy-teacher answers to {path}")
EOF
"$PYTHON" -m grpo_lightning sft fit --config configs/pipeline/1_cold_start_sft.yaml --model.model_name_or_path "$BASE"
report "1. cold-start SFT (sloppy teacher)" "$RUN/1_cold_start_sft" "$start"

# ---- stage 2: reasoning RL, rule-based reward
start=$SECONDS
"$PYTHON" -m grpo_lightning fit --config configs/pipeline/2_reasoning_rl.yaml
report "2. GRPO, exact-answer reward" "$RUN/2_reasoning_rl" "$start"

# ---- stage 3: rejection sampling from the stage-2 policy, then SFT of the stage-1 model on the accepted answers
start=$SECONDS
"$PYTHON" tools/rejection_sample.py --config configs/pipeline/2_reasoning_rl.yaml \
    --ckpt_path "$RUN/2_reasoning_rl/checkpoints/last.ckpt" --out "$RUN/3_rejection_sft/data.jsonl" \
    --k "$RS_K" --mode best --threshold 1.0 --num_prompts "$RS_PROMPTS"
"$PYTHON" -m grpo_lightning sft fit --config configs/pipeline/3_rejection_sft.yaml
report "3. rejection sampling + SFT" "$RUN/3_rejection_sft" "$start"

# ---- stage 4: second RL stage, exact_answer + reward model (trained here, from the stage-1 model)
start=$SECONDS
"$PYTHON" tools/train_reward_model.py --init "$RUN/1_cold_start_sft/hf" --out "$RUN/reward_model" --steps "$RM_STEPS"
"$PYTHON" -m grpo_lightning fit --config configs/pipeline/4_mixed_rl.yaml
report "4. GRPO, exact answer + reward model" "$RUN/4_mixed_rl" "$start"

# ---- stage 5: a smaller student (stage 1's SFT from random weights, same answers), then distilled from stage 4
start=$SECONDS
"$PYTHON" -m grpo_lightning sft fit --config configs/pipeline/5_student_cold_start.yaml
report "5a. smaller student's cold start (SFT, random weights)" "$RUN/5_student_cold_start" "$start"
start=$SECONDS
"$PYTHON" -m grpo_lightning fit --config configs/pipeline/5_distill.yaml
report "5b. on-policy distillation from stage 4" "$RUN/5_distill" "$start"

printf 'pipeline finished in %d s\n\n' $((SECONDS - PIPELINE_START))
cat "$TABLE"
