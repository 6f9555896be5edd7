#!/usr/bin/env bash
# Packed-weight speed against dense f16 and llama.cpp, in one sitting on one adapter (issue 34,
# item 3). For each model it makes llama-quantize files of each type, then per file runs
#   llama-bench -ngl 99 -p 64 -n 32 -r 2            (llama.cpp's Vulkan backend)
#   wgpar run, batch 1, prompt 64, 32 tokens        (the file's blocks, and --weights dense)
# on a single device, tensor parallel over 2 virtual devices and a 2-stage pipeline, and prints
# one markdown table of tokens/s with the ratios the issue targets.
#
#   bash examples/quant_speed.sh --smollm2 PATH/SmolLM2-135M-Instruct.Q4_1.gguf --out DIR
#   bash examples/quant_speed.sh --table DIR    # the table again from DIR's logs
#
# Options (each also an environment variable):
#   --smollm2 FILE     the real model (SMOLLM2; `.ci/fetch-model smollm2` fetches it)
#   --models LIST      smollm2,synthetic (MODELS; default both): synthetic is a random F16 Llama,
#                      hidden 2048, 2 layers, vocabulary 8192 (examples/write_dense_llama.py)
#   --types LIST       llama-quantize types (TYPES; default Q8_0,Q4_0,Q4_K_M,Q6_K,Q5_0)
#   --configs LIST     single,tp2,pp2 (CONFIGS; default all three)
#   --out DIR          files, raw logs and the table (OUT; default a new temporary folder)
#   --llamacpp DIR     llama-quantize and llama-bench (LLAMACPP_BIN; default: found on PATH)
#   --wgpar BIN        (WGPAR; default target/release/wgpar)
#   --python BIN       Python with gguf and numpy (WGPAR_PYTHON; default python3)
#   --dtype T          the float type of the packed runs' embeddings and LM head, and of the
#                      dense runs (DTYPE; default f16), so the runs differ only in the layers
#   --timeout S        most seconds one run may take (RUN_TIMEOUT; default 1800)
#   --no-warmup        skip the untimed warm-up run (prompt 64, 2 tokens) before each timed
#                      wgpar run; the warm-up leaves the kernels' first-use tuning out of the
#                      timed run (wgpar run does not warm up itself). The tuning cache is
#                      OUT/cache unless WGPAR_CACHE_DIR is set
#   --table DIR        no runs: the table again from an earlier run's logs in DIR
# A run that fails, is refused (e.g. TP2 on a model whose heads 2 does not split) or times out
# prints n/a in its cells; its log in OUT/logs says why. Tokens/s are computed from the token
# counts and milliseconds each tool prints (wgpar: prefill 64 tokens, decode 31 steps after the
# prefill's token; llama-bench: its pp64 and tg32 averages).
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"

SMOLLM2=${SMOLLM2:-}
MODELS=${MODELS:-smollm2,synthetic}
TYPES=${TYPES:-Q8_0,Q4_0,Q4_K_M,Q6_K,Q5_0}
CONFIGS=${CONFIGS:-single,tp2,pp2}
OUT=${OUT:-}
LLAMACPP_BIN=${LLAMACPP_BIN:-}
WGPAR=${WGPAR:-$root/target/release/wgpar}
PY=${WGPAR_PYTHON:-python3}
DTYPE=${DTYPE:-f16}
RUN_TIMEOUT=${RUN_TIMEOUT:-1800}
TABLE_ONLY=""
WARMUP=1
while [ $# -gt 0 ]; do
  case "$1" in
    --smollm2) SMOLLM2=$2; shift 2 ;;
    --models) MODELS=$2; shift 2 ;;
    --types) TYPES=$2; shift 2 ;;
    --configs) CONFIGS=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --llamacpp) LLAMACPP_BIN=$2; shift 2 ;;
    --wgpar) WGPAR=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --dtype) DTYPE=$2; shift 2 ;;
    --timeout) RUN_TIMEOUT=$2; shift 2 ;;
    --table) TABLE_ONLY=$2; shift 2 ;;
    --no-warmup) WARMUP=0; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "quant_speed: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done

fail() { echo "quant_speed: $*" >&2; exit 2; }

# Prefill and decode tokens/s of a `wgpar run` log, from its token counts and milliseconds
# (the printed rates have one decimal, too coarse for a slow driver); n/a where missing.
wgpar_rates() {
  awk '/^prefill: [0-9]+ tokens in [0-9.]+ ms/ && !pp { pp = $2 * 1000 / $5 }
       /^decode: [0-9]+ tokens x [0-9]+ sequences in [0-9.]+ ms/ && !tg { tg = $2 * $5 * 1000 / $8 }
       END { printf "%s %s\n", pp ? sprintf("%.4g", pp) : "n/a", tg ? sprintf("%.4g", tg) : "n/a" }' "$1"
}

# llama-bench's pp64 and tg32 averages, from its JSON lines; n/a where missing.
llama_rates() {
  local pp tg
  pp=$(grep '"n_prompt": 64, "n_gen": 0' "$1" | sed -E 's/.*"avg_ts": ([0-9.e+-]+).*/\1/')
  tg=$(grep '"n_prompt": 0, "n_gen": 32' "$1" | sed -E 's/.*"avg_ts": ([0-9.e+-]+).*/\1/')
  echo "${pp:-n/a} ${tg:-n/a}"
}

# DIR/results.tsv (model, type, config, phase, tokens/s) from the logs of the files DIR/order
# lists, then the markdown table, also saved as DIR/table.md.
tabulate() {
  local dir=$1 model type config weights pp tg
  : > "$dir/results.tsv"
  while read -r model type; do
    read -r pp tg < <(llama_rates "$dir/logs/$model-$type-llama.log" 2>/dev/null)
    printf '%s\t%s\t%s\t%s\t%s\n' "$model" "$type" llama.cpp pp "$pp" \
      "$model" "$type" llama.cpp tg "$tg" >> "$dir/results.tsv"
    for config in single tp2 pp2; do
      for weights in packed dense; do
        local log="$dir/logs/$model-$type-$config-$weights.log"
        [ -f "$log" ] || continue
        read -r pp tg < <(wgpar_rates "$log")
        printf '%s\t%s\t%s\t%s\t%s\n' "$model" "$type" "$config-$weights" pp "$pp" \
          "$model" "$type" "$config-$weights" tg "$tg" >> "$dir/results.tsv"
      done
    done
  done < "$dir/order"
  "$PY" "$root/examples/quant_speed_table.py" "$dir/results.tsv" | tee "$dir/table.md"
}

if [ -n "$TABLE_ONLY" ]; then
  [ -f "$TABLE_ONLY/order" ] || fail "--table $TABLE_ONLY: no earlier run's order file there"
  tabulate "$TABLE_ONLY"
  exit
fi
tool() {
  if [ -n "$LLAMACPP_BIN" ]; then echo "$LLAMACPP_BIN/$1"; else command -v "$1"; fi
}
QUANTIZE=$(tool llama-quantize) && [ -x "$QUANTIZE" ] || fail "no llama-quantize (--llamacpp DIR)"
BENCH=$(tool llama-bench) && [ -x "$BENCH" ] || fail "no llama-bench (--llamacpp DIR)"
[ -x "$WGPAR" ] || fail "no wgpar binary at $WGPAR (cargo build --release, or --wgpar)"
for m in ${MODELS//,/ }; do
  case "$m" in
    smollm2) [ -f "$SMOLLM2" ] || fail "--smollm2 FILE is needed for the smollm2 model" ;;
    synthetic) "$PY" -c 'import gguf, numpy' 2>/dev/null || fail "$PY lacks gguf or numpy" ;;
    *) fail "--models: unknown model '$m' (smollm2, synthetic)" ;;
  esac
done
for c in ${CONFIGS//,/ }; do
  case "$c" in single|tp2|pp2) ;; *) fail "--configs: unknown '$c' (single, tp2, pp2)" ;; esac
done
case "$DTYPE" in f16|f32) ;; *) fail "--dtype: '$DTYPE' (f16 or f32)" ;; esac
[[ "$RUN_TIMEOUT" =~ ^[1-9][0-9]*$ ]] || fail "--timeout: '$RUN_TIMEOUT' is not a positive count"
[ -n "$OUT" ] || OUT=$(mktemp -d)
mkdir -p "$OUT/files" "$OUT/logs" || fail "cannot write $OUT"
export WGPAR_CACHE_DIR=${WGPAR_CACHE_DIR-$OUT/cache}
: > "$OUT/order"

# The source file of each model (the synthetic one written once, then reused).
source_of() {
  case "$1" in
    smollm2) echo "$SMOLLM2" ;;
    synthetic)
      local f="$OUT/files/synthetic-f16.gguf"
      [ -s "$f" ] || "$PY" "$root/examples/write_dense_llama.py" "$f" >&2 || return 1
      echo "$f" ;;
  esac
}

# llama-bench on one file (pp64, tg32, two repetitions), its JSON lines in the log.
llama_bench() {
  local file=$2 log="$OUT/logs/$1-$3-llama.log"
  echo "  llama-bench $(basename "$file")"
  GGML_VK_VISIBLE_DEVICES=0 timeout "$RUN_TIMEOUT" "$BENCH" -m "$file" -ngl 99 -p 64 -n 32 -r 2 \
    -o jsonl > "$log" 2> "$log.err"
}

# One wgpar run (batch 1, prompt 64, 32 tokens), its output in the log.
wgpar_run() {
  local model=$1 type=$2 file=$3 config=$4 weights=$5
  local log="$OUT/logs/$model-$type-$config-$weights.log"
  local args=(run --model "$file" --batch 1 --prompt-len 64 --gen 32 --dtype "$DTYPE")
  [ "$weights" = dense ] && args+=(--weights dense)
  case "$config" in
    tp2) args+=(--strategy tp --virtual 2) ;;
    pp2) args+=(--strategy pp --virtual 2) ;;
  esac
  if [ "$WARMUP" = 1 ]; then
    local warm=("${args[@]}")
    warm[8]=2  # --gen 2: the prefill's and the decode's kernels tuned, untimed
    echo "\$ wgpar ${warm[*]}" > "${log%.log}-warmup.log"
    timeout "$RUN_TIMEOUT" "$WGPAR" "${warm[@]}" >> "${log%.log}-warmup.log" 2>&1
  fi
  echo "  wgpar ${args[*]}"
  echo "\$ wgpar ${args[*]}" > "$log"
  timeout "$RUN_TIMEOUT" "$WGPAR" "${args[@]}" >> "$log" 2>&1
}

echo "# quant_speed $(date -u +%Y-%m-%dT%H:%M:%SZ), out $OUT"
"$WGPAR" devices 2>&1 | head -5
for model in ${MODELS//,/ }; do
  src=$(source_of "$model") || fail "could not write the $model source file"
  for type in ${TYPES//,/ }; do
    file="$OUT/files/$model-$type.gguf"
    echo "== $model $type"
    if ! "$QUANTIZE" --allow-requantize "$src" "$file" "$type" > "$OUT/logs/$model-$type-quantize.log" 2>&1; then
      echo "  llama-quantize $type failed (see $OUT/logs/$model-$type-quantize.log)"
      continue
    fi
    # The new file's write-back would otherwise run beside the first timed runs (and the
    # kernel tuning inside them) on a machine with few cores.
    sync
    echo "$model $type" >> "$OUT/order"
    llama_bench "$model" "$file" "$type"
    for config in ${CONFIGS//,/ }; do
      for weights in packed dense; do
        wgpar_run "$model" "$type" "$file" "$config" "$weights"
      done
    done
  done
done
tabulate "$OUT"
