#!/usr/bin/env bash
# Reproduce the reference results of bench/results/ on one GPU host, through scripts/gpu-suite.
#
#   bench/gpu-reference.sh [PART...]      (default: models tests decode memory host-read)
#
# PART is one of
#   models     the synthetic test models (INT4 8 and 16 layers, BF16 2 layers); every other
#              part but table24, sweep24, streams24, prefetch24, prefill8k24, default24, soak24,
#              client24, pp2 (which make the 24-layer model, freeing the disk of these when it
#              is short)
#              and ple-file (its own model) makes them first
#              if they are missing, so start this one early (while the vLLM install finishes)
#              to save time later
#   tests      every GPU test (tests/gpu), correctness and kernels, with the measurements
#              (kernel timings, the PLE tables' cost)
#   tests-split  the GPU tests of the Qwen3-MoE test models (not Qwen4Exp's, PP or PLE) in
#              several processes side by side: the kernel files alone first (their timings),
#              then the unpatched reference runs and BF16, then four groups of engine tests at
#              EO_GPU_MEMORY_UTILIZATION=0.1 that read those runs (estimated 15-20 minutes on an
#              H200, not yet timed; summary.txt lists every PASSED/FAILED/ERROR line)
#   decode     five engines side by side at 10% host on the 16-layer model: unpatched,
#              offload-02, offload-03, offload-03-swap, --cpu-offload-gb
#   sweep      the whole suite: decode's group, offload-01, and offload-03-swap against
#              --cpu-offload-gb at 5, 20 and 40% host
#   memory     unpatched and offload-02 side by side: VRAM saved, host memory
#   host-read  the cost of one host-resident expert read, by path
#   cpu-experts  a decode step's host experts computed on this host's CPU (INT4, 1-4 tokens
#              each) beside the PCIe time of moving them (scripts/bench-cpu-experts; no GPU)
#   profile    offload-03-swap beside its unpatched engine, each profiled alone
#   serve      compose/tiny.yml's service without a container engine, with a short benchmark
#   prefill    offload-02 with and without prefill staging (VLLM_EXPERT_PREFILL_STAGING) beside
#              unpatched at 10% and 40% host on the 16-layer model: TTFT 2k/8k, decode
#   table24    the reference table on a 24-layer model (a 2x32GB stage's layers at the target
#              geometry): unpatched, offload-03-swap, offload-02 (each with and without
#              prefill staging), offload-03, --cpu-offload-gb at 10% host, TTFT 2k/8k/32k
#              against its bound, 1, 4 and 16 streams; two configurations beside each
#              unpatched engine (three units of 7-9 minutes on an H200; EO_TABLE24_CONFIGS
#              runs a subset, e.g. unpatched,offload-03,cpu-offload-gb)
#   sweep24    the 24-layer model at other host fractions, three configurations beside each
#              unpatched engine: offload-03-swap with prefill staging at 25% and 40% host
#              beside --cpu-offload-gb at 40% (decode, TTFT 2k/8k/32k against its bound), then
#              offload-03-swap at 5% and 20% beside --cpu-offload-gb at 20% (two units of
#              10-15 minutes on an H200; EO_SWEEP24_CONFIGS runs a subset)
#   prefill8k  prefill's parts again with 8192-token prefill chunks (one copy of the host
#              experts per 8k prompt instead of four), and offload-03-swap with and without
#              staging
#   streams    unpatched and offload-03-swap at 10% host on the 16-layer model, 1, 4 and 16
#              streams of mixed domains decoded together: total tokens/s, TPOT, swap counters
#   streams24  the same on the 24-layer model, with the swap as shipped and with +fast (a
#              decision every step, half-life 64, margin 1: simulate-swap's best setting for
#              mixed streams)
#   prefetch24 decode prefetch (VLLM_EXPERT_DECODE_PREFETCH) on the 24-layer model, 1, 4, 16 and
#              32 streams of mixed domains: unpatched, offload-03-swap+stage (the compose
#              default), +fast, and +prefetch at 10% host (51 of 512), then the default and
#              +prefetch at the 2x32GB default's share (134); three beside each unpatched
#              engine: total tokens/s, TPOT, host reads per token (two units of 10-15 minutes;
#              EO_PREFETCH24_CONFIGS runs a subset, e.g. unpatched,offload-03-swap+stage,
#              offload-03-swap+stage+prefetch for the 10% share alone)
#   prefill8k24  offload-03-swap with prefill staging at 10% and 40% host beside unpatched on
#              the 24-layer model, every engine with 8192-token prefill chunks (one copy of
#              the host experts per 8k of prompt instead of four): TTFT 2k/8k/32k, decode
#   default24  the compose files' default path at the 2x32GB default's host share (7.6 GiB per
#              card: 134 of 512 experts per layer, 26%) on the 24-layer model: unpatched,
#              offload-02 (the former default), offload-03-swap, and offload-03-swap with
#              prefill staging (the new default), three beside one unpatched engine: decode
#              fresh/repeated, TTFT 2k/8k/32k against its bound, 1, 4 and 16 streams, peak VRAM
#   ple-cost   Qwen4Exp's PLE n-gram tables in host memory against in VRAM, on the tiny Qwen4Exp
#              model with two 3.8 GiB tables (--ngram-vocab-base 8000000: far past the GPU's L2
#              cache, as the real 95 GiB tables are): greedy tokens, decode TPOT, prefill TTFT
#              (tests/gpu/test_ple_host_table.py; the offline bundle also needs EO_ENGINE_EXTRA
#              '{"attention_config": {"flash_attn_version": 2}, "gdn_prefill_backend": "triton"}')
#   ple-file   Qwen4Exp's PLE n-gram tables read from the checkpoint file (VLLM_PLE_TABLE=file)
#              against page-locked (host), on the tiny Qwen4Exp model with two ~16 GiB tables
#              (--ngram-vocab-base 34000000; 32 GiB of disk, the other models are not made):
#              greedy tokens, decode tok/s and p99 ITL, TTFT 2k/8k/32k, cold (pages evicted)
#              and warm, with and without the arrival prefetch, resident bytes after
#              (tests/gpu/test_ple_file_table.py: ple-file-vs-pinned.json/.md); then
#              scripts/bench-ple-file on a 16 GiB table file: the disk's 4 KiB random-read
#              IOPS at queue depth 1 and 64 and one layer's lookup (ple-file-read.json/.md)
#   soak24     scripts/soak on the 24-layer model at the 2x32GB default's share (134 of 512):
#              `vllm serve` with the default offload settings (one table, runtime swap with its
#              self-check, prefill staging, usage counting) under EO_SOAK_S (default 900) s of
#              mixed traffic, 1-16 requests in flight, prompts up to 32k tokens, cancellations:
#              self-check failures, VRAM and host RSS over time, greedy probes at start and
#              end, /metrics against the client's counts, clean shutdown (about 25 minutes)
#   client24   vLLM's own client beside this project's: scripts/bench-vllm serves the 24-layer
#              model with `vllm serve`, unpatched and then on the default path (one table, swap,
#              prefill staging) at the 2x32GB default's share (134 of 512), and runs
#              `vllm bench serve` against each (random dataset, 256 prompt and 128 output
#              tokens, concurrency 1, 4 and 16, three repeats): output tokens/s, TPOT, TTFT,
#              ratios against unpatched; with default24's results in R, both clients' ratios
#              side by side (run default24 first; about 20 minutes)
#   pp2        two GPUs: the Qwen4Exp test model at pipeline parallel 2 against unpatched PP=1
#              (tests/gpu/test_qwen4exp_pp2.py); unpatched, offload-02 and offload-03-swap at
#              PP=2 on a 24-layer model at 10% host side by side; compose/2x32GB.yml's command
#              line served with the Qwen4Exp model twice: a budget-only start, then the start
#              that uses what it learned
#
# Results go to R (default /tmp/eo-out), one folder per part with its logs, summary.txt, the
# report (JSON, Markdown, plots) and the engine runs packed as runs.tgz; R/PART.done marks a
# finished part. Timings are only comparable within one part's run: run each alone on the GPU.
# Environment: EO_VLLM_SITE (default /tmp/site) holds the pinned vLLM; everything else as for
# scripts/test-gpu. EO_BUDGET_S caps each part (default 1500 s). See docs/benchmarks.md.
set -u
cd "$(dirname "$0")/.."
R=${R:-/tmp/eo-out}
budget=${EO_BUDGET_S:-1500}
mkdir -p "$R"
export EO_VLLM_SITE=${EO_VLLM_SITE:-/tmp/site} PYTHONUNBUFFERED=1
export PYTHONPATH=${PYTHONPATH:-$EO_VLLM_SITE}
# every request is greedy; FlashInfer's top-k/top-p sampler warm-up only costs start-up time
export VLLM_USE_FLASHINFER_SAMPLER=0
M=${EO_GPU_WORK:-/tmp/eo-gpu}/models
T=tests/gpu/test_offload_correctness.py
# the 16-layer model at about 10% of routed experts on host
HOST10=(--model "$M/target-int4-16l" --host-experts-per-layer 51)
RUN=(--decode-tokens 128 --repeats 3 --host-read-us 55.5 --copy-gbps 55.3)
# the 24-layer model at the 2x32GB default's share: 7.6 GiB per card of a stage's 29 GiB of
# routed experts (26.2%), 134 of each layer's 512
HOST24=134

# the patched copy of vLLM (made once, before any engine needs it)
patched() {
  scripts/test-gpu --collect-only -q tests/gpu/test_smoke.py > "$R/patch.log" 2>&1
}

# the 8- and 16-layer and BF16 models, then the patched copy
models() {
  if [[ ! -f $M/target-int4-16l/.complete || ! -f $M/target-bf16-2l/.complete ]]; then
    scripts/gpu-suite --budget-s 300 --out "$R/models" 'model:target-int4-8l:--layers 8' \
      'model:target-int4-16l:--layers 16' 'model:target-bf16-2l:--layers 2 --quant bf16' ||
      return 1
  fi
  patched
}

# tests-split: one scripts/test-gpu process per call, its log in R/tests-split/NAME.log
tg() {
  local name=$1
  shift
  timeout "$budget" scripts/test-gpu "$@" -rA -s --durations=0 > "$R/tests-split/$name.log" 2>&1
}

tests_split() {
  local rc=0 pids=() pid
  mkdir -p "$R/tests-split"
  tg kernels tests/gpu/test_vmm_gpu.py tests/gpu/test_swap_kernels_gpu.py \
    tests/gpu/test_expert_map_kernels.py tests/gpu/test_shared_expert_split.py \
    tests/gpu/test_decode_prefetch_gpu.py --measurements || rc=1
  # engine tests share the GPU from here on; the first makes the reference runs (five
  # unpatched engines side by side) that the others read
  export EO_GPU_MEMORY_UTILIZATION=${EO_GPU_MEMORY_UTILIZATION:-0.1}
  tg reference $T -k "split_experts_match_unpatched and 2048 or bf16" || rc=1
  tg one-table $T -k "one_table_matches_unpatched or decode_prefetch" &
  pids+=($!)
  tg refused $T -k refused &
  pids+=($!)
  tg offload02 $T -k "split_experts_match_unpatched and 512 or memory_moves or host_layer" &
  pids+=($!)
  tg staging tests/gpu/test_prefill_staging_gpu.py tests/gpu/test_prefill_staging_one_table_gpu.py \
    tests/gpu/test_counting_engine.py tests/gpu/test_smoke.py &
  pids+=($!)
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
  grep -h "^PASSED\|^FAILED\|^ERROR\|^SKIPPED" "$R/tests-split"/*.log > "$R/tests-split/summary.txt"
  date -u +%FT%TZ > "$R/tests-split.done"
  return $rc
}

# the 24-layer model (31 GiB; with the 8- and 16-layer ones a 64 GiB disk is full, so those
# two go first when space is short)
model24() {
  local free
  free=$(df --output=avail -B1G "$(dirname "$M")" | tail -1)
  if [[ ! -f $M/target-int4-24l/.complete ]] && ((free < 36)); then
    echo "gpu-reference: ${free} GiB free; removing the 8- and 16-layer models for the 24-layer one"
    rm -rf "$M/target-int4-8l" "$M/target-int4-16l"
  fi
  scripts/gpu-suite --budget-s 600 --out "$R/model24" 'model:target-int4-24l:--layers 24'
}

part() {
  local name=$1
  shift
  scripts/gpu-suite --budget-s "$budget" --out "$R/$name" "$@"
  local rc=$?
  date -u +%FT%TZ > "$R/$name.done"
  return $rc
}

run_part() {
  case $1 in
    models) models ;;
    tests) part tests "tests:tests/gpu -rA -s --measurements" ;;
    tests-split) tests_split ;;
    decode)
      part decode "bench:${HOST10[*]} --configs unpatched,offload-02,offload-03,offload-03-swap,cpu-offload-gb --group 4 ${RUN[*]} --out OUT/decode.json"
      ;;
    sweep)
      part sweep "bench:${HOST10[*]} --host-layers 0,1 --configs unpatched,offload-02,offload-03,offload-03-swap,cpu-offload-gb,offload-03-swap:205,cpu-offload-gb:205,offload-01,offload-03-swap:26,cpu-offload-gb:26,offload-03-swap:102,cpu-offload-gb:102 --group 4 ${RUN[*]} --out OUT/sweep.json"
      ;;
    memory)
      part memory "bench:${HOST10[*]} --configs unpatched,offload-02 --group 4 ${RUN[*]} --out OUT/vram.json"
      ;;
    host-read)
      mkdir -p "$R/host-read"
      PYTHONPATH=scripts:${EO_VLLM_PATCHED:-/tmp/vllm-patched}:$EO_VLLM_SITE timeout 300 \
        python3 scripts/bench-host-read --out "$R/host-read/host_read.json" > "$R/host-read/host_read.log" 2>&1
      ;;
    cpu-experts)
      mkdir -p "$R/cpu-experts"
      PYTHONPATH=scripts:$EO_VLLM_SITE timeout 900 python3 scripts/bench-cpu-experts \
        --out "$R/cpu-experts/cpu_experts.json" > "$R/cpu-experts/cpu_experts.log" 2>&1
      local rc=$?
      date -u +%FT%TZ > "$R/cpu-experts.done"
      return $rc
      ;;
    profile)
      part profile "bench:${HOST10[*]} --host-layers 0,1 --configs unpatched,offload-03-swap --paired --profile --decode-tokens 256 --repeats 1 --host-read-us 55.5 --out OUT/profile.json"
      ;;
    serve) part serve 'serve:--attention-backend TRITON_ATTN --gpu-memory-utilization 0.1' ;;
    prefill)
      part prefill "bench:${HOST10[*]} --configs unpatched,offload-02,offload-02+stage,offload-02:205,offload-02:205+stage --group 4 ${RUN[*]} --out OUT/prefill.json"
      ;;
    table24)
      model24 || return 1
      local configs=${EO_TABLE24_CONFIGS:-unpatched,offload-03-swap,offload-03-swap+stage,offload-02,offload-02+stage,offload-03,cpu-offload-gb}
      part table24 "bench:--model $M/target-int4-24l --host-experts-per-layer 51 --configs $configs --group 2 --ttft-32k --streams 1,4,16 ${RUN[*]} --out OUT/table24.json"
      ;;
    sweep24)
      model24 || return 1
      local configs=${EO_SWEEP24_CONFIGS:-unpatched,offload-03-swap:128+stage,offload-03-swap:205+stage,cpu-offload-gb:205,offload-03-swap:26,offload-03-swap:102,cpu-offload-gb:102}
      part sweep24 "bench:--model $M/target-int4-24l --host-experts-per-layer 51 --configs $configs --group 3 --ttft-32k ${RUN[*]} --out OUT/sweep24.json"
      ;;
    prefill8k)
      EO_ENGINE_EXTRA='{"max_num_batched_tokens": 8192}' part prefill8k "bench:${HOST10[*]} --configs unpatched,offload-02,offload-02+stage,offload-02:205,offload-02:205+stage,offload-03-swap,offload-03-swap+stage --group 4 ${RUN[*]} --out OUT/prefill8k.json"
      ;;
    streams)
      part streams "bench:${HOST10[*]} --configs unpatched,offload-03-swap --group 2 --streams 1,4,16 ${RUN[*]} --out OUT/streams.json"
      ;;
    streams24)
      model24 || return 1
      part streams24 "bench:--model $M/target-int4-24l --host-experts-per-layer 51 --configs unpatched,offload-03-swap,offload-03-swap+fast --group 2 --streams 1,4,16 ${RUN[*]} --out OUT/streams24.json"
      ;;
    prefetch24)
      model24 || return 1
      local configs=${EO_PREFETCH24_CONFIGS:-unpatched,offload-03-swap+stage,offload-03-swap+fast+stage,offload-03-swap+stage+prefetch,offload-03-swap:$HOST24+stage,offload-03-swap:$HOST24+stage+prefetch}
      part prefetch24 "bench:--model $M/target-int4-24l --host-experts-per-layer 51 --configs $configs --group 3 --streams 1,4,16,32 ${RUN[*]} --out OUT/prefetch24.json"
      ;;
    prefill8k24)
      model24 || return 1
      EO_ENGINE_EXTRA='{"max_num_batched_tokens": 8192}' part prefill8k24 "bench:--model $M/target-int4-24l --host-experts-per-layer 51 --configs unpatched,offload-03-swap+stage,offload-03-swap:205+stage --group 2 --ttft-32k ${RUN[*]} --out OUT/prefill8k24.json"
      ;;
    default24)
      model24 || return 1
      part default24 "bench:--model $M/target-int4-24l --host-experts-per-layer $HOST24 --configs unpatched,offload-02,offload-03-swap,offload-03-swap+stage --group 3 --ttft-32k --streams 1,4,16 ${RUN[*]} --out OUT/default24.json"
      ;;
    ple-cost)
      EO_QWEN4EXP_MAKE_ARGS="--arch qwen4_exp --preset tiny --quant int4 --ngram-vocab-base 8000000" \
        EO_GPU_MEMORY_UTILIZATION=0.3 part ple-cost "tests:tests/gpu/test_ple_host_table.py -rA -s --measurements"
      ;;
    ple-file)
      local work=${EO_GPU_WORK:-/tmp/eo-gpu} rc=0
      EO_QWEN4EXP_MAKE_ARGS="--arch qwen4_exp --preset tiny --quant int4 --ngram-vocab-base 34000000" \
        EO_GPU_MEMORY_UTILIZATION=0.25 part ple-file "tests:tests/gpu/test_ple_file_table.py -rA -s --measurements" || rc=1
      mkdir -p "$R/ple-file-read"
      cp "$work"/ple-file-vs-pinned.json "$work"/ple-file-vs-pinned.md "$R/ple-file-read/" || rc=1
      PYTHONPATH=scripts:${EO_VLLM_PATCHED:-/tmp/vllm-patched}:$EO_VLLM_SITE \
        timeout 1500 python3 scripts/bench-ple-file --dir "$work/ple-file" --table-gib 16 \
        --out "$R/ple-file-read/ple-file-read.json" > "$R/ple-file-read/bench.log" 2>&1 || rc=1
      return $rc
      ;;
    soak24)
      model24 || return 1
      mkdir -p "$R/soak24"
      # the kernel warm-up settings every engine run of this bundle uses (gpu_harness)
      local kernels='{"enable_jit_warmup": false, "enable_flashinfer_autotune": false}'
      PYTHONPATH=scripts:${EO_VLLM_PATCHED:-/tmp/vllm-patched}:$EO_VLLM_SITE \
        timeout $((${EO_SOAK_S:-900} + 2400)) python3 scripts/soak --model "$M/target-int4-24l" \
        --host-experts-per-layer $HOST24 --duration-s "${EO_SOAK_S:-900}" --out "$R/soak24" -- \
        --max-model-len 34816 --kv-cache-memory-bytes 4294967296 --attention-backend TRITON_ATTN \
        --kernel-config "$kernels" > "$R/soak24/soak.log" 2>&1
      local rc=$?
      date -u +%FT%TZ > "$R/soak24.done"
      return $rc
      ;;
    client24)
      model24 || return 1
      mkdir -p "$R/client24"
      local kernels='{"enable_jit_warmup": false, "enable_flashinfer_autotune": false}'
      local compare=()
      [[ -f $R/default24/default24.json ]] && compare=(--compare-with "$R/default24/default24.json")
      PYTHONPATH=scripts:$EO_VLLM_SITE timeout 3600 python3 scripts/bench-vllm \
        --model "$M/target-int4-24l" --host-experts-per-layer $HOST24 --suite vllm-client24 \
        --vllm-patched "${EO_VLLM_PATCHED:-/tmp/vllm-patched}" --out "$R/client24" \
        "${compare[@]}" -- --kv-cache-memory-bytes 4294967296 --attention-backend TRITON_ATTN \
        --kernel-config "$kernels" > "$R/client24/client24.log" 2>&1
      local rc=$?
      date -u +%FT%TZ > "$R/client24.done"
      return $rc
      ;;
    pp2)
      local q4=$M/qwen4exp-tiny-int4 small=(--max-model-len 4096 --kv-cache-memory-bytes 1073741824)
      model24 || return 1
      scripts/gpu-suite --budget-s 120 --out "$R/pp2-model" \
        'model:qwen4exp-tiny-int4:--arch qwen4_exp --preset tiny --quant int4' || return 1
      part pp2 "tests:tests/gpu/test_qwen4exp_pp2.py -rA -s" \
        "bench:--model $M/target-int4-24l --host-experts-per-layer 51 --pp-size 2 --configs unpatched,offload-02,offload-03-swap --group 2 ${RUN[*]} --out OUT/pp2-24l.json" \
        "serve:--compose compose/2x32GB.yml --model $q4 ${small[*]} --attention-backend TRITON_ATTN" \
        "serve:--compose compose/2x32GB.yml --model $q4 ${small[*]} --attention-backend TRITON_ATTN"
      ;;
  esac
}

(($# > 0)) || set -- models tests decode memory host-read
for p in "$@"; do
  case $p in
    models | tests | tests-split | decode | sweep | memory | host-read | cpu-experts | profile | serve | prefill | table24 | sweep24 | prefill8k | streams | streams24 | prefetch24 | prefill8k24 | default24 | ple-cost | ple-file | soak24 | client24 | pp2) ;;
    *)
      echo "error: unknown part '$p' (see the comment at the top of $0)" >&2
      exit 2
      ;;
  esac
done
rc=0
for p in "$@"; do
  case $p in
    models | cpu-experts) ;;
    table24 | sweep24 | streams24 | prefetch24 | prefill8k24 | default24 | soak24 | client24 | pp2 | ple-file) patched || true ;; # they make their own models
    *) models || true ;;
  esac
  run_part "$p" || rc=1
done
exit $rc
