#!/usr/bin/env bash
# Retrain the Qwen3 EAGLE3 head in several variants at once (one process each, sharing the GPU);
# each variant's head, cards, metrics and log tail end up in OUT/<name>.tar.
#   bash scripts/head_variants.sh OUT "name:--set k=v --set k=v" ...
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: head_variants.sh OUT "name:--set k=v ..." ...}; shift
mkdir -p "$out"
pids=()
for spec in "$@"; do
  name=${spec%%:*}; sets=${spec#*:}
  rm -rf "/tmp/v_$name" "/tmp/w_$name"; cp -r foretell/default_models "/tmp/v_$name"
  # shellcheck disable=SC2086
  python3 recipes/default_models/train.py --out "/tmp/v_$name" --work "/tmp/w_$name" --family qwen3 --reuse-lms \
    $sets > "/tmp/v_$name.log" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
for spec in "$@"; do
  name=${spec%%:*}
  tail -c 20000 "/tmp/v_$name.log" > "/tmp/v_$name/run.log"
  python3 - "/tmp/v_$name" "$name" <<'PY'
import json, sys
m = json.load(open(f"{sys.argv[1]}/recipe_metrics.json"))["measured"]
e, t = m["eagle3"], m["teacher_forced"]["engine_walk"]
print(sys.argv[2], "eagle3 mean length", e.get("mean_acceptance_length"), "per position", e.get("acceptance_per_position"),
      "teacher-forced", t["acceptance_per_position"])
PY
  tar -C "/tmp/v_$name" -cf "$out/$name.tar" qwen3-eagle3 qwen3-target/README.md qwen3-draft/README.md README.md \
    recipe_metrics.json run.log
done
