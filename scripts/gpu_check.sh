#!/usr/bin/env bash
# The GPU check of lpsync (docs/gpu.md): on a machine with a CUDA GPU, install what is
# needed, run the `gpu` tests (several client processes sharing the GPU), measure the CUDA
# IPC copy path against a device-to-device copy on 256 MiB, sweep a 4-process allreduce,
# and print a short table last. Without a GPU it says so and exits 0.
#   scripts/gpu_check.sh            # from the checkout; ~5 min on one GPU
# Env: GPU_CHECK_VENV (default .venv-gpu), GPU_CHECK_SIZES (default 1MiB:256MiB).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU on this machine (nvidia-smi finds none): nothing to check."
    exit 0
fi
nvidia-smi -L

# The CUDA major version the driver supports picks the cupy wheel.
cuda_major=$(nvidia-smi | sed -n 's/.*CUDA Version: \([0-9]*\).*/\1/p' | head -1)
extra=cuda12
[ "${cuda_major:-12}" -ge 13 ] && extra=cuda13

venv=${GPU_CHECK_VENV:-.venv-gpu}
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q -e ".[test,$extra]" -e clients/python
py="$venv/bin/python"
out=$(mktemp -d /tmp/lpsync-gpu-check.XXXXXX)
trap 'rm -rf "$out"' EXIT

echo "== gpu tests (pytest -m gpu: several client processes share GPU 0)"
set +e
timeout 420 "$py" -m pytest -q -m gpu tests/daemon/test_daemon_gpu.py -rs -p no:cacheprovider \
    --junitxml="$out/junit.xml" 2>&1 | tail -25
tests_rc=${PIPESTATUS[0]}
set -e

echo "== 256 MiB copy: through CUDA IPC vs device to device"
timeout 120 "$py" - "$out/copy.json" <<'PY'
import json, sys
from lpsync.bench import ipc_copy
result = ipc_copy.measure(256 << 20)
print(ipc_copy.report(result))
json.dump(result, open(sys.argv[1], "w"))
PY

echo "== allreduce, 4 processes sharing GPU 0"
timeout 300 "$venv/bin/lpsync" bench --memory cuda --devices cuda:0 --procs 4 --op allreduce \
    --bytes "${GPU_CHECK_SIZES:-1MiB:256MiB}" --iters 10 --warmup 2 --json > "$out/allreduce.json"

"$py" - "$out" "$tests_rc" <<'PY'
import json, sys, xml.etree.ElementTree as ET
out, rc = sys.argv[1], int(sys.argv[2])
suite = ET.parse(f"{out}/junit.xml").getroot()
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
copy = json.load(open(f"{out}/copy.json"))
bench = json.load(open(f"{out}/allreduce.json"))
print("\n# lpsync GPU check")
print(f"| check | result |\n|---|---|")
print(f"| pytest -m gpu | {suite.get('tests')} tests, {suite.get('failures')} failed, "
      f"{suite.get('errors')} errors, {suite.get('skipped')} skipped (rc {rc}) |")
ratio = copy["ipc_over_d2d"]
print(f"| 256 MiB copy, D2D | {copy['d2d_gbps']:.1f} GB/s |")
print(f"| 256 MiB copy, CUDA IPC | {copy['ipc_gbps']:.1f} GB/s ({100 * ratio:.0f}% of D2D; "
      f"target >= 80%: {'met' if ratio >= 0.8 else 'NOT met'}) |")
for row in bench["results"]["lpsync"]:
    print(f"| allreduce 4 procs, {row['size'] / 2**20:g} MiB | {row['time_us']:.0f} us, busbw "
          f"{row['busbw_gbps']:.1f} GB/s, {row['algorithm']}, #wrong {row['wrong']} |")
sys.exit(1 if rc or any(r["wrong"] for r in bench["results"]["lpsync"]) else 0)
PY
