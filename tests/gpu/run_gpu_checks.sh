#!/usr/bin/env bash
# Every GPU test and GPU benchmark of the quantization/kernel/CUDA-graph work, in stages, each under its own time
# limit. A session has 15 minutes of device time and one command at most 10: the default limits sum to 1,150 s (tests
# 150 + 65, bench 125, shapes 85, gguf 70, long 35, moe 40 + 45, hybrid 120 + 60 + 45, encoder 90, ple 120 + 100),
# bounds rather than what the stages take: run them in three calls of at most 425, 415 and 310 s, STAGES="tests bench
# shapes" tests/gpu/run_gpu_checks.sh, then STAGES="gguf long moe hybrid", then STAGES="encoder ple" (a session short
# of device time runs the stages of what it changed first; stages: tests, bench,
# shapes, gguf, long, moe, hybrid, encoder, ple; default all nine, in that order). summary.txt gets each stage's
# seconds, to size the limits from. A tenth stage, gemma4 (the shapes section at Gemma 4 E4B's and 31B's shapes,
# 240 s), runs only when named, in a call of its own: STAGES=gemma4 tests/gpu/run_gpu_checks.sh. So does cpuisa (the
# CPU kernels' interleaved GGUF tiles, int16 path and attention on the host's CPU, whose AVX-512/VNNI build an AVX2
# development machine does not run: their products, batch independence, the 16-lane tiles and attention against the
# 8-lane ones' invariants, and the AVX2 and portable builds' bits against it, 240 s; the gguf wheel must be on
# PYTHONPATH, e.g. carried in shared/).
# Writes under $OUT (default ./gpu-results): summary.txt, pytest logs, gpu_bench.json/.txt, gpu_shapes.json/.txt,
# gguf_bench.json/.txt, gpu_long_context.json/.txt, moe_bench.json/.txt, moe_models.json/.txt, hybrid_bench.json/.txt,
# hybrid_models.json/.txt, encoders.json/.txt, pytest_ple.txt, ple.json/.txt (and gpu_shapes_gemma4.json/.txt,
# pytest_cpuisa.txt).
set -u -o pipefail  # a failing pytest or benchmark, not tee, decides each step's status
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/gpu-results}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"  # the GPU machine's python3 is the one with torch
unset TRITON_INTERPRET
export PYTHONSAFEPATH=1  # the repository root off sys.path: its kernels/ would shadow Hugging Face's `kernels`
export PYTHONPATH="$PWD/tests:${PYTHONPATH:-}"
# the project may not be installed on the GPU machine: lay out the import package the way setuptools maps it
if ! "$PY" -c "import llmd" 2>/dev/null; then
  SHIM="$(mktemp -d)"
  mkdir "$SHIM/llmd"
  for f in "$PWD"/daemon/*; do ln -s "$f" "$SHIM/llmd/"; done
  ln -s "$PWD/kernels" "$SHIM/llmd/kernels"
  ln -s "$PWD/tui" "$SHIM/llmd/tui"
  export PYTHONPATH="$SHIM:$PYTHONPATH"
fi
status=0
STAGES=" ${STAGES:-tests bench shapes gguf long moe hybrid encoder ple} "
wants() { [[ "$STAGES" == *" $1 "* ]]; }
took() { echo "   ($1: $((SECONDS - $2)) s)" | tee -a "$OUT/summary.txt"; }  # a stage's wall time
# Most of the tests' time is Triton compiling kernels (hundreds of variants, about a second each on one core). With
# pytest-xdist the seven files run side by side, one per worker, so the wall time is the slowest file's, not the sum.
PARALLEL=()
if "$PY" -c "import xdist" 2>/dev/null; then PARALLEL=(-n 7 --dist loadfile); fi
: > "$OUT/summary.txt"
if wants tests; then
echo "== GPU tests" | tee -a "$OUT/summary.txt"
t0=$SECONDS
timeout 150 "$PY" -m pytest -q -m gpu -p no:cacheprovider ${PARALLEL[@]+"${PARALLEL[@]}"} --durations=15 \
  tests/test_kernels_quant_matmul.py tests/test_kernels_paged_attention.py tests/test_kernels_prefill_attention.py tests/test_kv_int8.py \
  tests/test_cuda_graphs.py tests/test_kernels_gguf_matmul.py tests/test_kernels_moe_matmul.py \
  2>&1 | tee "$OUT/pytest_gpu.txt" | tail -5 | tee -a "$OUT/summary.txt" || status=1
# the sliding-window and attention-sink Triton kernels: every test of the files (on the GPU when there is one)
timeout 65 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels_sliding_window.py \
  tests/test_kernels_attention_sinks.py \
  2>&1 | tee "$OUT/pytest_window.txt" | tail -2 | tee -a "$OUT/summary.txt" || status=1
took tests "$t0"
fi
if wants bench; then
echo "== GPU benchmarks" | tee -a "$OUT/summary.txt"
t0=$SECONDS
timeout 125 "$PY" tests/gpu/bench_gpu.py --out "$OUT" 2>&1 | tee "$OUT/gpu_bench.txt" || status=1
took bench "$t0"
fi
# random-weight Gemma 3 4B and Qwen2.5-7B of real shapes, bf16 and int8: prefill, decode b1/b16, GB/s, memory (a
# table line per model and mode as it finishes; after the bench stage, whose int8 kernels it reuses compiled)
if wants shapes; then
echo "== real model shapes (Gemma 3 4B, Qwen2.5-7B)" | tee -a "$OUT/summary.txt"
t0=$SECONDS
timeout 85 "$PY" tests/gpu/bench_gpu.py --out "$OUT" --sections shapes --name gpu_shapes 2>&1 \
  | tee "$OUT/gpu_shapes.txt" | grep -A6 "^model " | tee -a "$OUT/summary.txt" || status=1
took shapes "$t0"
fi
# random-weight Gemma 4 E4B (per-layer embeddings, 18 of 42 layers reading earlier layers' K/V) and 31B (all 60
# layers: 62 GB of bf16; global layers with 512-wide heads, V from K), bf16 and int8, as the shapes stage measures
# them; each row's model is built and freed in turn. An estimate not yet run: summary.txt gets its seconds.
if wants gemma4; then
echo "== real model shapes (Gemma 4 E4B, 31B)" | tee -a "$OUT/summary.txt"
t0=$SECONDS
timeout 240 "$PY" tests/gpu/bench_gpu.py --out "$OUT" --sections shapes --models gemma4-e4b,gemma4-31b \
  --name gpu_shapes_gemma4 2>&1 | tee "$OUT/gpu_shapes_gemma4.txt" | grep -A6 "^model " | tee -a "$OUT/summary.txt" \
  || status=1
took gemma4 "$t0"
fi
# GGUF packed matmul per type (Q4_K_M's kernels are compiled by then: the GPU tests autotuned the same shapes; MXFP4,
# gpt-oss's expert type, compiles and autotunes its tilings here: about 30 s of the 70, an estimate not yet run)
if wants gguf; then
echo "== GGUF matmul benchmark (Q4_K, Q6_K, Q5_0, Q8_0, MXFP4)" | tee -a "$OUT/summary.txt"
t0=$SECONDS
timeout 70 "$PY" tests/gpu/bench_gpu.py --out "$OUT" --sections gguf_kernels --name gguf_bench 2>&1 \
  | tee "$OUT/gguf_bench.txt" || status=1
took gguf "$t0"
fi
if wants long; then
echo "== long-context decode (8k, 32k; bf16 and int8 KV)" | tee -a "$OUT/summary.txt"
t0=$SECONDS
timeout 35 "$PY" tests/gpu/bench_gpu.py --out "$OUT" --sections long_context --name gpu_long_context 2>&1 \
  | tee "$OUT/gpu_long_context.txt" | tail -4 | tee -a "$OUT/summary.txt" || status=1
took long "$t0"
fi
# the fused MoE kernel at gpt-oss-20b's (MXFP4) and Qwen3-30B-A3B's (Q4_K) expert shapes, batch 1, 4, 16: GB/s of
# the hit experts' bytes, each result checked against the torch reference. About 18 compiles (a second or less
# each) and its autotuning: an estimate not yet run; summary.txt gets its seconds. Then a tiny random Nemotron-H MoE
# (Mamba2, attention and squared-ReLU expert layers: tests/gpu/check_models.py, section moe) in bf16 against its CPU
# fp32 logits (the Mamba2 and fp-expert kernels compile at its tiny shapes: 45 s, an estimate not yet run).
if wants moe; then
echo "== fused MoE kernel (gpt-oss-20b MXFP4, Qwen3-30B-A3B Q4_K)" | tee -a "$OUT/summary.txt"
t0=$SECONDS
timeout 40 "$PY" tests/gpu/bench_gpu.py --out "$OUT" --sections moe --name moe_bench 2>&1 \
  | tee "$OUT/moe_bench.txt" | grep "^moe " | tee -a "$OUT/summary.txt" || status=1
timeout 45 "$PY" tests/gpu/check_models.py --out "$OUT" --sections moe --name moe_models 2>&1 \
  | tee "$OUT/moe_models.txt" | grep "^model \|^check_models\|Error" | tee -a "$OUT/summary.txt" || status=1
took moe "$t0"
fi
# the recurrent layers of hybrid models (Qwen3.5's Gated DeltaNet and the Mamba2 layers of Granite 4 / Nemotron-H,
# llmd.kernels.recurrent_triton): every test of the kernels' file on the GPU (its Qwen3.5-9B and Granite-4.0-H-Small
# layer-shape tests and the model's functions choosing the kernels among them), then one Qwen3.5-9B layer's conv and
# delta rule and one Granite-4.0-H-Small layer's conv and scan at decode batch 1 and 16 and for a 2k-token prefill
# chunk (chunked, token by token, the torch reference once), each checked against the reference. About 25 compiles
# of 6 kernels in the tests, 9 in the benchmark: limits estimated, not yet run. Then a tiny random Qwen3-Next (Gated
# DeltaNet with fused projections, gated attention, MoE with a shared expert: tests/gpu/check_models.py, section
# hybrid) in bf16 against its CPU fp32 logits (45 s, an estimate not yet run).
if wants hybrid; then
echo "== recurrent layers (Qwen3.5-9B Gated DeltaNet, Granite-4.0-H-Small Mamba2: conv, delta rule, scan)" \
  | tee -a "$OUT/summary.txt"
t0=$SECONDS
timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels_recurrent_triton.py \
  2>&1 | tee "$OUT/pytest_hybrid.txt" | tail -2 | tee -a "$OUT/summary.txt" || status=1
timeout 60 "$PY" tests/gpu/bench_gpu.py --out "$OUT" --sections hybrid --name hybrid_bench 2>&1 \
  | tee "$OUT/hybrid_bench.txt" | grep "^hybrid " | tee -a "$OUT/summary.txt" || status=1
timeout 45 "$PY" tests/gpu/check_models.py --out "$OUT" --sections hybrid --name hybrid_models 2>&1 \
  | tee "$OUT/hybrid_models.txt" | grep "^model \|^check_models\|Error" | tee -a "$OUT/summary.txt" || status=1
took hybrid "$t0"
fi
# the vision towers (llmd.model.vision) at real widths, random weights: Gemma 3 4B's SigLIP, Qwen3-VL-8B's (the
# Qwen3.5 tower with DeepStack), Mistral Small 3.1's Pixtral; 4 layers on CUDA in bf16 and fp32 against the CPU in
# fp32 on one image of the real size, then the full-depth tower's encode ms per image (tests/gpu/check_models.py,
# section encoders; no Triton: 90 s, an estimate not yet run).
if wants encoder; then
echo "== vision towers (Gemma 3 SigLIP, Qwen3-VL DeepStack, Pixtral): CUDA vs CPU fp32, encode ms" \
  | tee -a "$OUT/summary.txt"
t0=$SECONDS
timeout 90 "$PY" tests/gpu/check_models.py --out "$OUT" --sections encoders --name encoders 2>&1 \
  | tee "$OUT/encoders.txt" | grep "^encoder \|^check_models\|Error" | tee -a "$OUT/summary.txt" || status=1
took encoder "$t0"
fi
# Gemma 4's per-layer embedding table in host memory beside a model on CUDA (llmd.model.host_table): the tiny E-model
# from its folder and its Q8_0 GGUF (the GPU tests of test_gemma4*.py), then E4B's widths and 262k vocabulary with 6
# layers (tests/gpu/check_models.py, section ple): the table's device, bf16 logits against CPU fp32, the lookup's time.
# The GGUF kernels compile at the tiny shapes; E4B's CPU fp32 reference holds 6.5 GB: limits estimated, not yet run.
if wants ple; then
echo "== Gemma 4 per-layer embeddings on the host (tiny folder and Q8_0 GGUF; E4B widths, 6 layers)" \
  | tee -a "$OUT/summary.txt"
t0=$SECONDS
timeout 120 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_gemma4.py tests/test_gemma4_gguf.py \
  2>&1 | tee "$OUT/pytest_ple.txt" | tail -2 | tee -a "$OUT/summary.txt" || status=1
timeout 100 "$PY" tests/gpu/check_models.py --out "$OUT" --sections ple --name ple 2>&1 \
  | tee "$OUT/ple.txt" | grep "^model \|^ple \|^check_models\|Error" | tee -a "$OUT/summary.txt" || status=1
took ple "$t0"
fi
if wants cpuisa; then
echo "== CPU interleaved GGUF tiles on this host's ISA ($(grep -o -m1 'avx512_vnni\|avx_vnni\|avx2' /proc/cpuinfo))" \
  | tee -a "$OUT/summary.txt"
t0=$SECONDS
timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels_cpu_interleaved.py tests/test_kernels_cpu_gguf.py \
  tests/test_kernels_cpu_ops.py -k "interleav or products or rows_do_not or avx2_build or portable or head_path or attention \
  or attends" 2>&1 \
  | tee "$OUT/pytest_cpuisa.txt" | tail -2 | tee -a "$OUT/summary.txt" || status=1
took cpuisa "$t0"
fi
exit $status
