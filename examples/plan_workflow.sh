#!/usr/bin/env bash
# A planning session, end to end, on a laptop (no GPU, no torch import).
# Run from the repository root: bash examples/plan_workflow.sh [OUT_DIR]
set -euo pipefail
out=${1:-plan-example}
mkdir -p "$out"

# 1. The built-in default: LLaMA-2 7B on 8 nodes x 8 H100-80GB, global batch 512 x 4096 tokens.
python3 -m tessera plan

# 2. LLaMA-3 70B on 1,024 H100s, beside the baselines (Megatron-style, pure FSDP, ...), saved.
python3 -m tessera plan --model llama3-70b --gpus 1024 --gpus-per-node 8 --gpu h100-80gb \
    --global-batch 1024 --seq-len 8192 --compare -o "$out/llama3-70b.json"

# 3. The same job planned by hand, with an 8-stage pipeline: the same cost model predicts it.
python3 -m tessera plan --model llama3-70b --gpus 1024 --global-batch 1024 --seq-len 8192 \
    --dp 16 --tp 8 --pp 8 --sp megatron --zero 1 --recompute selective --schedule interleaved_1f1b \
    --virtual-stages 2 -o "$out/llama3-70b-pp8.json"

# 4. A model from its Hugging Face config.json, on a cluster described in a JSON file
#    (write your own with `tessera profile hardware`; --gpus resizes it).
python3 -m tessera plan --model examples/open-llama-3b \
    --cluster examples/cluster-a100-2x8.json --global-batch 256 --seq-len 2048 -o "$out/open-llama-3b.json"

# 5. Pictures, PNG and SVG: the hand plan's pipeline timeline (8 stages x 64 micro-batches: the whole
#    step, and zooms of its start and end labelled by micro-batch) and the memory of each stage.
python3 -m tessera show "$out/llama3-70b-pp8.json" -o "$out"
ls "$out"

# 6. For scripts: the plan JSON on stdout.
python3 -m tessera plan --model llama2-13b --gpus 32 --global-batch 256 --json > "$out/llama2-13b.json"
