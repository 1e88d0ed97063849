#!/usr/bin/env bash
# The GPU check, on a machine with an NVIDIA GPU as it is lent: the driver, CUDA's libraries, Python
# with torch and transformers; no Rust, no network. Everything it runs was built elsewhere by
# `./dev gpu-bundle OUT` and sits beside this script; the fixtures come from the repository copy it
# runs in (MMGATE_REPO, else the current directory or the one above the bundle).
#
#   OUT/run.sh                  report in OUT/results (or $MMGATE_GPU_REPORT_DIR)
#
# Each step has its own time limit (together under 8 minutes), and a step that fails or times out
# does not stop the others; the exit status is 1 when any did. Without a CUDA driver it stops at
# the first GPU step, says so and exits with 3 (2: the bundle is not whole). It writes
# results/report.json (every step: status, seconds, the lines that matter) and results/summary.txt.
set -uo pipefail

bundle=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
started=$(date +%s)
report_dir=${MMGATE_GPU_REPORT_DIR:-$bundle/results}
mkdir -p "$report_dir"
steps="$report_dir/steps"
rm -rf "$steps" && mkdir -p "$steps"
work=$(mktemp -d "${TMPDIR:-/tmp}/mmgate-gpu-check.XXXXXX")
trap 'rm -rf "$work"' EXIT

say() { printf '==> %s\n' "$*"; }

# A step's outcome: NAME STATUS SECONDS (the report lists steps in the order they ended).
record() {
  echo "$2" >"$steps/$1.status"
  echo "$3" >"$steps/$1.seconds"
  echo "$1" >>"$steps/order"
}

# One step: NAME LIMIT_SECONDS COMMAND...; its output is kept in steps/NAME.log, its outcome in
# steps/NAME.status (ok, failed, timed out, skipped) and the seconds it took in steps/NAME.seconds.
step() {
  local name=$1 limit=$2
  shift 2
  say "$name (at most ${limit}s)"
  local t0 rc status
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >"$steps/$name.log" 2>&1
  rc=$?
  case $rc in
    0) status=ok ;;
    124 | 137) status="timed out" ;;
    *) status="failed ($rc)" ;;
  esac
  record "$name" "$status" $(($(date +%s) - t0))
  tail -n 5 "$steps/$name.log" | sed 's/^/    /'
  say "$name: $status"
}

skip() {
  local name=$1
  shift
  echo "$*" >"$steps/$name.log"
  record "$name" "skipped: $*" 0
  say "$name: skipped ($*)"
}

# report.json and summary.txt from the steps so far.
finish() {
  python3 - "$steps" "$report_dir" "$started" <<'PY'
import json, os, sys, time
steps, out, started = sys.argv[1], sys.argv[2], int(sys.argv[3])
with open(os.path.join(steps, "order")) as f:
    names = f.read().split()
def read(name, ext):
    try:
        with open(os.path.join(steps, f"{name}.{ext}"), errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""
report = {"seconds": int(time.time()) - started, "steps": []}
for name in names:
    log = read(name, "log").splitlines()
    keep = [l for l in log if any(k in l for k in ("test result", "relative error", "GPU", "ratio", "error", "panicked", "ms", "{"))]
    report["steps"].append({"name": name, "status": read(name, "status").strip(),
                            "seconds": int(read(name, "seconds").strip() or 0), "lines": (keep or log)[-40:]})
with open(os.path.join(out, "report.json"), "w") as f:
    json.dump(report, f, indent=1)
with open(os.path.join(out, "summary.txt"), "w") as f:
    for s in report["steps"]:
        f.write(f"{s['name']:<12} {s['status']:<24} {s['seconds']:>4}s\n")
    f.write(f"{'total':<12} {'':<24} {report['seconds']:>4}s\n")
PY
  cat "$report_dir/summary.txt"
}

repo=${MMGATE_REPO:-}
if [ -z "$repo" ]; then
  for candidate in "$PWD" "$bundle/.." "$bundle/../.."; do
    if [ -d "$candidate/tests/fixtures/models" ]; then
      repo=$(cd "$candidate" && pwd)
      break
    fi
  done
fi

# The bundle is whole: every file its manifest lists, unchanged.
say "bundle"
if ! (cd "$bundle" && sha256sum --quiet -c MANIFEST) >"$steps/bundle.log" 2>&1; then
  record bundle "failed: the bundle's files do not match its MANIFEST" 0
  cat "$steps/bundle.log"
  finish
  exit 2
fi
mkdir -p "$work/bin"
for packed in "$bundle"/bin/*.gz; do
  gzip -dc "$packed" >"$work/bin/$(basename "$packed" .gz)"
done
chmod +x "$work"/bin/*
record bundle "ok: $(ls "$work/bin" | tr '\n' ' ')" 0
say "bundle: ok; repository: ${repo:-not found (the parity steps need its tests/fixtures)}"

# The first GPU step: the GPU and its driver.
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi >"$steps/gpu.log" 2>&1; then
  echo "no CUDA driver: nvidia-smi is missing or cannot talk to a driver; nothing else can run here" \
    | tee "$steps/gpu.log"
  record gpu "no CUDA driver" 0
  finish
  exit 3
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader \
  | tee "$steps/gpu.log"
record gpu ok 0

# cuBLAS and NVRTC as mmgate loads them (by their unversioned names): the toolkit's, or the ones
# PyTorch's CUDA wheels carry, linked into one directory put first on the library path.
libs="$work/cuda-libs"
mkdir -p "$libs"
find_lib() {
  local name=$1 dir found
  for dir in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu \
    $(python3 -c 'import glob, site; print(" ".join(glob.glob(site.getsitepackages()[0] + "/nvidia/*/lib") + glob.glob(site.getsitepackages()[0] + "/nvidia/*/*/lib")))' 2>/dev/null); do
    found=$(ls "$dir"/"$name".so* 2>/dev/null | sort -V | tail -n 1)
    if [ -n "$found" ]; then
      echo "$found"
      return 0
    fi
  done
  return 1
}
for name in libcublas libcublasLt libnvrtc; do
  if found=$(find_lib "$name"); then
    ln -sf "$found" "$libs/$name.so"
    for builtins in "$(dirname "$found")"/libnvrtc-builtins.so*; do
      [ -e "$builtins" ] && ln -sf "$builtins" "$libs/"
    done
    say "$name: $found"
  else
    say "$name: not found"
  fi
done
export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export MMGATE_REPO="$repo"

bin=$work/bin
# Every kernel compiled by NVRTC for this GPU's architecture and the ones CI checks.
step kernels 30 "$bin/cuda_nvrtc" --nocapture
# Every operation of the CUDA backend against the CPU backend.
step ops 45 "$bin/cuda_gpu" --ignored --nocapture
torch_gpu=false
if python3 -c 'import torch, transformers; assert torch.cuda.is_available()' >/dev/null 2>&1; then
  torch_gpu=true
fi
# transformers itself on this GPU against the logits it made on the CPU (the parity fixtures): with
# the next steps, how far mmgate on the GPU is from transformers on the same GPU.
if $torch_gpu && [ -n "$repo" ]; then
  step transformers 40 python3 "$repo/gpu-check/transformers_on_gpu.py"
else
  skip transformers "PyTorch with CUDA or the repository is missing"
fi
# Each family's encoder and LLM on CUDA against transformers' outputs (f32; Qwen2-VL also bf16).
if [ -n "$repo" ]; then
  step qwen2-vl 45 "$bin/qwen2_vl_parity" on_real_gpus --ignored --nocapture
  step qwen2-audio 30 "$bin/qwen2_audio_parity" on_real_gpus --ignored --nocapture
  step qwen3-vl 30 "$bin/qwen3_vl_parity" on_real_gpus --ignored --nocapture
else
  skip qwen2-vl "no repository with tests/fixtures (set MMGATE_REPO)"
fi
# The engine: batched requests on the GPU as solo runs on the CPU.
step engine 45 "$bin/engine" on_real_gpus --ignored --nocapture

# The gateway serving a chat request with its encoder and LLM on the GPU.
serve() {
  local port=18181 config="$work/serve.toml"
  cat >"$config" <<TOML
listen = "127.0.0.1:$port"
[[models]]
name = "demo"
path = "demo"
encoder_devices = [{ device = "cuda:0" }]
llm_device = "cuda:0"
TOML
  XDG_CACHE_HOME="$work/cache" "$bin/mmgate" serve --config "$config" >"$work/serve.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 100); do
    curl -sf "http://127.0.0.1:$port/ready" >/dev/null 2>&1 && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
  {
    printf '{"model": "demo", "max_tokens": 8, "messages": [{"role": "user", "content": ['
    printf '{"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,'
    base64 -w0 "$repo/tests/fixtures/image/images/photo-640x480.jpg"
    printf '"}}, {"type": "text", "text": "Describe it."}]}]}'
  } >"$work/chat.json"
  curl -sS --fail-with-body --max-time 60 "http://127.0.0.1:$port/v1/chat/completions" \
    -H 'content-type: application/json' --data-binary @"$work/chat.json"
  local rc=$?
  echo
  kill "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  tail -n 20 "$work/serve.log"
  return $rc
}
missing=$(ldd "$bin/mmgate" 2>/dev/null | grep 'not found' | awk '{print $1}' | tr '\n' ' ')
if [ -n "$missing" ]; then
  skip serve "this machine lacks the shared libraries mmgate links: $missing"
elif ! command -v curl >/dev/null; then
  skip serve "no curl here"
else
  export -f serve
  export bin work repo
  step serve 45 bash -c serve
fi

# Speed: the vision tower and a prefill + decode step against PyTorch eager on the same GPU, on a
# random model of Qwen2-VL 2B's shapes made here (no weights to download).
if $torch_gpu && [ -n "$repo" ]; then
  step speed 165 env MMGATE_GPU_BENCH_BIN="$bin/gpu_bench" \
    MMGATE_GPU_BENCH_MODEL="${MMGATE_GPU_BENCH_MODEL:-$work/qwen2-vl-2b-random}" python3 "$repo/bench/gpu.py"
else
  skip speed "PyTorch with CUDA or the repository is missing"
fi

finish
# Failed if any step failed or ran out of time (skipped steps say why in the report).
! grep -qE '^(failed|timed out)' "$steps"/*.status
