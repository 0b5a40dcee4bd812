#!/usr/bin/env bash
# The GPU check of lpsync (docs/gpu.md): on a machine with a CUDA GPU and no network, with
# that machine's own python3 and packages (cupy, numpy, pytest, ...) and the project on
# PYTHONPATH: run every `gpu` test (client processes sharing a GPU through CUDA IPC, two
# daemons on loopback peers, a GPU named under another ordinal), measure the CUDA IPC copy
# path against a device-to-device copy on 256 MiB, sweep a 4-process allreduce on one
# daemon and on two (the hierarchical pipeline across loopback peers, staged through the
# pinned ring and then direct from device memory through UCX's cuda transports) and, with a GPU per
# rank, through NCCL, and print a table last. Without a GPU it says so and exits 0. About
# 8 minutes on one H200.
#   scripts/gpu_wheels.sh     # once, on a machine with network: the missing wheels
#   scripts/gpu_check.sh      # on the GPU machine, from the checkout (.gpu-wheels beside it)
# Env: GPU_CHECK_PYTHON (default python3), GPU_CHECK_WHEELS (default .gpu-wheels),
#      GPU_CHECK_SIZES (default 1MiB:256MiB), GPU_CHECK_OUT (keep the raw results there).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU on this machine (nvidia-smi finds none): nothing to check."
    exit 0
fi
nvidia-smi -L
py=${GPU_CHECK_PYTHON:-python3}
wheels=${GPU_CHECK_WHEELS:-.gpu-wheels}
out=${GPU_CHECK_OUT:-$(mktemp -d /tmp/lpsync-gpu-check.XXXXXX)}
mkdir -p "$out"
site=$(mktemp -d /tmp/lpsync-gpu-site.XXXXXX)
trap 'rm -rf "$site"' EXIT

# The machine's packages, the missing ones from the wheels (no index), the project itself.
if compgen -G "$wheels/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl
fi
export PYTHONPATH="$site:$PWD:$PWD/clients/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
echo "== environment"
"$py" - <<'PY'
import sys, importlib.metadata as m
print("python", sys.version.split()[0])
for name in ("cupy-cuda13x", "cupy-cuda12x", "grpcio", "protobuf", "numpy", "torch", "ucxx-cu12"):
    try:
        print(f"  {name} {m.version(name)}")
    except m.PackageNotFoundError:
        pass
import cupy
print("  GPUs visible to cupy:", cupy.cuda.runtime.getDeviceCount(), "driver", cupy.cuda.runtime.driverGetVersion())
import lpsync.cli, lpsync_client  # everything the daemon and the client import, found
PY

echo "== gpu tests (pytest -m gpu)"
set +e
# Only the files that hold gpu tests: the others may import what this image lacks.
mapfile -t gpu_tests < <(grep -rlE "mark\.gpu|kinds\(" tests --include='test_*.py' | sort)
timeout 280 "$py" -m pytest -q -m gpu "${gpu_tests[@]}" -rs -p no:cacheprovider --timeout 200 \
    --junitxml="$out/junit.xml" 2>&1 | tail -40
tests_rc=${PIPESTATUS[0]}

echo "== 256 MiB copy: through CUDA IPC vs device to device"
timeout 60 "$py" -m lpsync.bench.ipc_copy --mib 256 --json "$out/copy.json"

echo "== allreduce, 4 processes sharing GPU 0"
timeout 120 "$py" -m lpsync.cli bench --memory cuda --devices cuda:0 --procs 4 --op allreduce \
    --bytes "${GPU_CHECK_SIZES:-1MiB:256MiB}" --iters 10 --warmup 2 --json > "$out/allreduce.json"

echo "== allreduce, 4 processes on 2 daemons (loopback peers): the hierarchical device pipeline"
timeout 180 "$py" -m lpsync.cli bench --memory cuda --devices cuda:0 --procs 4 --local-nodes 2 \
    --op allreduce --bytes "${GPU_CHECK_SIZES:-1MiB:256MiB}" --iters 10 --warmup 2 --json \
    > "$out/allreduce_2daemons.json"

echo "== the same with the direct device path: UCX (cuda_copy, cuda_ipc) sends the boundary's device memory"
timeout 180 "$py" -m lpsync.cli bench --memory cuda --devices cuda:0 --procs 4 --local-nodes 2 \
    --peer-device-path device --op allreduce --bytes "${GPU_CHECK_SIZES:-1MiB:256MiB}" --iters 10 \
    --warmup 2 --json > "$out/allreduce_2daemons_direct.json"

echo "== allreduce through NCCL (torch.distributed), one process per GPU"
timeout 180 "$py" -m lpsync.bench.nccl --sizes "${GPU_CHECK_SIZES:-1MiB:256MiB}" --iters 10 \
    --json "$out/nccl.json"
set -e

"$py" - "$out" "$tests_rc" <<'PY'
import json, os, sys, xml.etree.ElementTree as ET
out, rc = sys.argv[1], int(sys.argv[2])
def load(name):
    path = os.path.join(out, name)
    try:
        return json.load(open(path)) if name.endswith(".json") else ET.parse(path).getroot()
    except (OSError, ValueError, ET.ParseError):
        return None
print("\n# lpsync GPU check")
print("| check | result |\n|---|---|")
suite = load("junit.xml")
if suite is None:
    print(f"| pytest -m gpu | no report (rc {rc}) |")
else:
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    print(f"| pytest -m gpu | {suite.get('tests')} tests, {suite.get('failures')} failed, "
          f"{suite.get('errors')} errors, {suite.get('skipped')} skipped (rc {rc}) |")
copy = load("copy.json")
if copy is None:
    print("| 256 MiB copy | not measured (see above) |")
else:
    ratio = copy["ipc_over_d2d"]
    print(f"| 256 MiB copy, D2D | {copy['d2d_gbps']:.1f} GB/s |")
    print(f"| 256 MiB copy, CUDA IPC | {copy['ipc_gbps']:.1f} GB/s ({100 * ratio:.0f}% of D2D; "
          f"target >= 80%: {'met' if ratio >= 0.8 else 'NOT met'}) |")
bench = load("allreduce.json")
wrong = 0
if bench is None:
    print("| allreduce 4 procs | not measured (see above) |")
else:
    for row in bench["results"]["lpsync"]:
        wrong += row["wrong"]
        print(f"| allreduce 4 procs, {row['size'] / 2**20:g} MiB | {row['time_us']:.0f} us, busbw "
              f"{row['busbw_gbps']:.1f} GB/s, {row['algorithm']}, #wrong {row['wrong']} |")
def against(rows, label, base, versus, missing):
    """Print each row with its speed over the same size in ``base``; the #wrong count."""
    if rows is None:
        print(f"| allreduce 4 procs on 2 daemons{label} | {missing} |")
        return 0
    by_size = {row["size"]: row for row in base["results"]["lpsync"]} if base else {}
    for row in rows["results"]["lpsync"]:
        other = by_size.get(row["size"])
        ratio = f", {other['time_us'] / row['time_us']:.2f}x {versus}" if other else ""
        print(f"| allreduce 4 procs on 2 daemons{label}, {row['size'] / 2**20:g} MiB | {row['time_us']:.0f} us, "
              f"algbw {row['algbw_gbps']:.2f} GB/s{ratio}, #wrong {row['wrong']} |")
    return sum(row["wrong"] for row in rows["results"]["lpsync"])
two = load("allreduce_2daemons.json")
wrong += against(two, "", bench, "the one-daemon speed", "not measured (see above)")
direct = load("allreduce_2daemons_direct.json")
wrong += against(direct, ", direct", two, "the staged path's speed",
                 "not measured (see above: UCX without cuda transports refuses --peer-device-path device)")
nccl = load("nccl.json")
if nccl is None or not nccl.get("results"):
    why = (nccl or {}).get("skipped", "not measured (see above)")
    print(f"| allreduce through NCCL | {why} |")
else:
    for row in nccl["results"]:
        print(f"| allreduce through NCCL, {nccl['world']} GPUs, {row['size'] / 2**20:g} MiB | "
              f"{row['time_us']:.0f} us, algbw {row['algbw_gbps']:.2f} GB/s |")
sys.exit(1 if rc or wrong or copy is None or bench is None or two is None else 0)
PY
