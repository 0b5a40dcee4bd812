#!/usr/bin/env bash
# The GPU check of lpsync (docs/gpu.md, "The GPU check"): on a machine with a CUDA GPU and
# no network, with that machine's own python3 and packages (the GPU image: Python 3.12,
# torch, cupy-cuda13x, numpy, ml_dtypes, pytest, prometheus-client; no ucxx) plus the
# wheels of scripts/gpu_wheels.sh (the gRPC stack), the project on PYTHONPATH:
#   preflight     imports, the options each step passes, the gpu tests' collection, and the
#                 device-path profile on the emulated device; with only the image's
#                 packages importable (anything else installed is refused, so that CI
#                 finds what the image lacks: tests/test_gpu_preflight.py)
#   gpu tests     every `gpu`-marked test (client processes sharing a GPU through CUDA IPC,
#                 two daemons on loopback peers, a GPU named under another ordinal)
#   ipc copy      256 MiB through CUDA IPC against a device-to-device copy
#   allreduce     4 processes on one daemon, then on two (the hierarchical pipeline across
#                 loopback peers, staged through the pinned ring), then the same with the
#                 direct device path (needs ucxx: reported as not run where it is missing)
#   profile       where a small device collective's fixed cost goes, step by step
#   nccl          allreduce through torch.distributed, one process per GPU
# Every step has its own time limit (together <= 6 minutes); a step that fails or runs out
# of time is reported and the next runs; the table is printed last whatever happened, and
# a machine-readable result (result.json: each step's status, seconds and figures, the
# profile) is written to GPU_CHECK_OUT. Without a GPU it runs the preflight only and says so.
#   scripts/gpu_wheels.sh               # once, on a machine with network: the missing wheels
#   scripts/gpu_check.sh                # on the GPU machine, from the checkout (.gpu-wheels beside it)
#   scripts/gpu_check.sh --preflight    # anywhere: what the GPU run would need, checked in seconds
# Env: GPU_CHECK_PYTHON (default python3), GPU_CHECK_WHEELS (default .gpu-wheels),
#      GPU_CHECK_SIZES (default 1MiB:64MiB), GPU_CHECK_OUT (default a fresh /tmp folder),
#      GPU_CHECK_IMAGE_PACKAGES (the image's distributions, space-separated; default below).
set -uo pipefail  # no -e: a failing step is reported, never the end of the check
cd "$(dirname "$0")/.."

mode=check
case "${1:-}" in
    --preflight) mode=preflight ;;
    "") ;;
    *) echo "usage: scripts/gpu_check.sh [--preflight]" >&2; exit 2 ;;
esac
if [ "$mode" = check ] && ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
    echo "gpu_check: no NVIDIA GPU on this machine (nvidia-smi finds none): the preflight only."
    mode=preflight
fi
[ "$mode" = check ] && nvidia-smi -L
py=${GPU_CHECK_PYTHON:-python3}
wheels=${GPU_CHECK_WHEELS:-.gpu-wheels}
sizes=${GPU_CHECK_SIZES:-1MiB:64MiB}
out=${GPU_CHECK_OUT:-$(mktemp -d /tmp/lpsync-gpu-check.XXXXXX)}
mkdir -p "$out"
: > "$out/steps.tsv"
site=$(mktemp -d /tmp/lpsync-gpu-site.XXXXXX)
trap 'rm -rf "$site"' EXIT
# What the GPU image holds (docs/gpu.md; the 2026-12-04 runs): the distributions the check
# may import besides the wheels' and the standard library. grpcio, protobuf, the health
# and reflection services come from the wheels.
export GPU_CHECK_IMAGE_PACKAGES=${GPU_CHECK_IMAGE_PACKAGES:-"numpy ml_dtypes ml-dtypes cupy-cuda13x \
cupy-cuda12x fastrlock torch nvidia-ml-py pytest iniconfig packaging pluggy pygments \
prometheus-client prometheus_client typing-extensions typing_extensions filelock sympy mpmath \
networkx jinja2 markupsafe fsspec setuptools triton pip"}
# What scripts/gpu_wheels.sh fetches (tests/test_gpu_preflight.py keeps the two in step).
export GPU_CHECK_WHEEL_PACKAGES="grpcio grpcio-health-checking grpcio-reflection protobuf"
export PYTHONPATH="$site:$PWD:$PWD/clients/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

# step NAME LIMIT_S COMMAND...: run it under its own limit, log to $out/NAME.log, record
# (name, exit status, seconds, limit) and show the log's tail.
step() {
    local name=$1 limit=$2 started rc
    shift 2
    echo "== $name (limit ${limit} s)"
    started=$(date +%s%N)
    # bash -c: a step may be one of the functions below (exported), or a command.
    timeout --kill-after=2 "$limit" bash -c '"$@"' step "$@" > "$out/$name.log" 2>&1
    rc=$?
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((($(date +%s%N) - started) / 1000000))" "$limit" >> "$out/steps.tsv"
    tail -n 12 "$out/$name.log"
    return 0
}
skip() {  # skip NAME WHY
    echo "== $1: not run ($2)"
    printf '%s\tskip\t0\t0\t%s\n' "$1" "$2" >> "$out/steps.tsv"
}

install_wheels() {
    if compgen -G "$wheels/*.whl" >/dev/null; then
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl
    else
        echo "no wheels in $wheels (scripts/gpu_wheels.sh): the image's own packages only"
    fi
}

# The preflight: run with only the image's and the wheels' distributions importable.
preflight() {
    "$py" - "$wheels" "$out" "$mode" <<'PY'
import importlib, importlib.abc, importlib.metadata as md, json, os, re, sys
wheels, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
names = os.environ["GPU_CHECK_IMAGE_PACKAGES"].split() + os.environ["GPU_CHECK_WHEEL_PACKAGES"].split()
allowed = {re.sub(r"[-_.]+", "-", n).lower() for n in names}
owners = md.packages_distributions()  # top-level module -> the distributions that ship it
project = {"lpsync", "lpsync_client", "lab", "tests"}

class ImageOnly(importlib.abc.MetaPathFinder):
    """Refuse a top-level module that only a distribution outside the image provides."""
    refused: set[str] = set()
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        dists = {re.sub(r"[-_.]+", "-", d).lower() for d in owners.get(top, ())}
        if top in project or top in sys.stdlib_module_names or not dists or dists & allowed:
            return None
        self.refused.add(f"{top} ({', '.join(sorted(dists))})")
        raise ModuleNotFoundError(f"{top} is not in the GPU image (from {', '.join(sorted(dists))})")

sys.meta_path.insert(0, ImageOnly())
problems = []
modules = ["lpsync.cli", "lpsync.daemon.control.server", "lpsync.daemon.launch", "lpsync_client",
           "lpsync.bench.ipc_copy", "lab.nccl", "lpsync.engine.device_group",
           "lpsync.memory.emulated", "lpsync.transport.ucx.device_support"]
for name in modules:
    try:
        importlib.import_module(name)
    except Exception as error:
        problems.append(f"import {name}: {error!r}")
print("python", sys.version.split()[0], "| allowed distributions:", len(allowed))
for dist in ("cupy-cuda13x", "cupy-cuda12x", "torch", "numpy", "grpcio", "protobuf", "pytest"):
    try:
        print(f"  {dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        pass
# The options every step passes, parsed by the parsers the steps run.
import shlex
steps = {
    "lpsync.cli": [f"bench --memory cuda --devices cuda:0 --procs 4 --op allreduce --bytes 1MiB:64MiB --iters 5 --warmup 1 --json",
                   f"bench --memory cuda --devices cuda:0 --procs 4 --local-nodes 2 --op allreduce --bytes 1MiB:64MiB --iters 5 --warmup 1 --json",
                   f"bench --memory cuda --devices cuda:0 --procs 4 --local-nodes 2 --peer-device-path device --op allreduce --bytes 1MiB:64MiB --iters 5 --warmup 1 --json"],
}
try:
    from lpsync.cli import build_parser
    for argv in steps["lpsync.cli"]:
        try:
            build_parser().parse_args(shlex.split(argv))
        except SystemExit:
            problems.append(f"lpsync {argv}: the options do not parse")
except Exception as error:
    problems.append(f"lpsync.cli's parser: {error!r}")
for module, argv in (("lpsync.bench.ipc_copy", "--mib 256 --json x"), ("lab.nccl", "--sizes 1MiB:64MiB --iters 10 --json x")):
    try:
        source = open(importlib.util.find_spec(module).origin).read()
        for option in re.findall(r"--[a-z][a-z-]+", argv):
            if f'"{option}"' not in source:
                problems.append(f"{module} has no option {option}")
    except Exception as error:
        problems.append(f"{module}: {error!r}")
# The gpu tests' collection, under the same refusal (a file that imports what the image
# lacks would be an error here, and a failed step on the GPU).
import pytest, io, contextlib
files = sorted({os.path.join(d, f) for d, _, fs in os.walk("tests") for f in fs
                if f.startswith("test_") and f.endswith(".py")
                and re.search(r"mark\.gpu|kinds\(", open(os.path.join(d, f)).read())})
buffer = io.StringIO()
os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # only what the image's pytest surely has
with contextlib.redirect_stdout(buffer):
    rc = pytest.main(["--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider", *files])
collected = sum(1 for line in buffer.getvalue().splitlines() if "::" in line)
if rc not in (0, 5):
    problems.append(f"collecting the gpu tests failed (pytest exit {rc}): " + buffer.getvalue()[-2000:])
print(f"  gpu tests collected: {collected} in {len(files)} files")
for line in problems:
    print("PROBLEM:", line)
json.dump({"problems": problems, "refused": sorted(ImageOnly.refused), "gpu_tests": collected,
           "files": files}, open(os.path.join(out, "preflight.json"), "w"), indent=1)
sys.exit(1 if problems else 0)
PY
}

# The fixed cost of a small device collective, step by step (median and p90 of 50 runs
# each): what the daemon does per collective below the RPC, on DEVICES (cuda:0 on the GPU,
# emulated:2 in the preflight, which checks that the profile itself runs).
profile() {
    "$py" - "$1" "$out/profile.json" <<'PY'
import json, statistics, sys, time
import numpy as np
from lpsync.algorithms import generate
from lpsync.engine.device_group import DeviceContext, DeviceGroup
from lpsync.memory.devices import open_kind, parse_devices
from lpsync.memory.kind import Span
from lpsync.reduction import Reduction
from lpsync.types import Collective, ReduceOp
spec, path = sys.argv[1], sys.argv[2]
kind = open_kind(parse_devices(spec))
devices = sorted(getattr(kind, "allowed", range(kind.devices)))
f32, u8, count = np.dtype(np.float32), np.dtype(np.uint8), 1024
rows = {}
def timed(name, work, reps=50):
    work()  # warm: kernels, first allocations
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        work()
        times.append((time.perf_counter() - started) * 1e6)
    times.sort()
    rows[name] = {"median_us": statistics.median(times), "p90_us": times[int(0.9 * len(times))]}
d0 = devices[0]
stream, event = kind.stream(d0), kind.event(d0)
def sync():
    kind.record(event, stream)
    kind.synchronize(event, time.monotonic() + 30)
a, b, c = (kind.allocate(d0, count * 4) for _ in range(3))
host = kind.allocate_host(count * 4, d0)
A, B, C, H = Span(a, 0, count, f32), Span(b, 0, count, f32), Span(c, 0, count, f32), Span(host, 0, count, f32)
kind.write(A, np.ones(count, np.float32)); kind.write(B, np.ones(count, np.float32)); kind.read(A)
timed("record + synchronize (idle stream)", sync)
timed("copy_async D2D 4 KiB + synchronize", lambda: (kind.copy_async(C, A, stream), sync()))
timed("copy_async D2H 4 KiB (pinned) + synchronize", lambda: (kind.copy_async(H, A, stream), sync()))
timed("copy_async H2D 4 KiB (pinned) + synchronize", lambda: (kind.copy_async(A, H, stream), sync()))
reduction = Reduction(ReduceOp.SUM, f32, 2)
timed("reduce_async 1024 float32 + synchronize", lambda: (kind.reduce_async(reduction, C, A, B, True, stream), sync()))
if len(devices) > 1:
    d1 = devices[1]
    far = kind.allocate(d1, count * 4)
    timed("copy_async peer 4 KiB + synchronize", lambda: (kind.copy_async(Span(far, 0, count, f32), A, stream), sync()))
# A whole plan: 4 participants' allreduce of 4 KiB each (LP chain), replayed.
context = DeviceContext(kind)
on = [devices[r * len(devices) // 4] for r in range(4)]
keep = [(kind.allocate(d, count * 4), kind.allocate(d, count * 4)) for d in on]
pairs = [(Span(i, 0, count, f32), Span(o, 0, count, f32)) for i, o in keep]
started = time.perf_counter()
group = DeviceGroup(context, generate(Collective.ALLREDUCE, "lp", 4, count, 0, 1), pairs, Reduction(ReduceOp.SUM, f32, 4))
rows["plan a 4-participant allreduce (once per shape)"] = {"median_us": (time.perf_counter() - started) * 1e6, "p90_us": None}
timed("enqueue the plan (the ops' launch cost)", lambda: (group.enqueue(), group.wait(time.monotonic() + 30)), reps=1)
timed("run the plan: enqueue + wait", lambda: group.run(time.monotonic() + 30))
# Issue 47: items 2 (the plan captured at its first launch, then one graph launch) and 1
# (answered at enqueue: the time to the answer, the streams finishing after it).
owner, later = ("profile",), lambda: time.monotonic() + 60
timed("launch, captured and replayed (item 2) + wait", lambda: group.launch(owner, later(), [], []).wait(later()))
pending = []
timed("launch to its answer, not its end (item 1)", lambda: pending.append(group.launch(owner, later(), [], [])))
for launch in pending:
    launch.wait(later())
context.capture = False
issued = DeviceGroup(context, generate(Collective.ALLREDUCE, "lp", 4, count, 0, 1), pairs, Reduction(ReduceOp.SUM, f32, 4))
timed("launch, issued op by op (capture off) + wait", lambda: issued.launch(owner, later(), [], []).wait(later()))
issued.close(); group.close(); context.close()
for name, row in rows.items():
    p90 = f"{row['p90_us']:.0f}" if row["p90_us"] is not None else "-"
    print(f"  {row['median_us']:9.0f} us median, {p90:>6} us p90  {name}")
json.dump({"devices": spec, "bytes": count * 4, "steps": rows}, open(path, "w"), indent=1)
kind.close_kind()
PY
}

export py wheels out mode site
export -f install_wheels preflight profile
# The limits add up to 335 s (+2 s each to kill a step that ignores SIGTERM): <= 6 minutes.
pre_limit=30  # on the GPU machine; CI's shared cores get more (the preflight mode is unbounded)
[ "$mode" = preflight ] && pre_limit=150
step install 25 install_wheels
step preflight "$pre_limit" preflight
if [ "$mode" = preflight ]; then
    step profile 60 profile emulated:2
else
    step gpu_tests 95 "$py" -m pytest -q -m gpu $(grep -rlE "mark\.gpu|kinds\(" tests --include='test_*.py' | sort) \
        -rs -p no:cacheprovider --junitxml="$out/junit.xml"
    step ipc_copy 20 "$py" -m lpsync.bench.ipc_copy --mib 256 --json "$out/copy.json"
    step allreduce 35 sh -c "\"$py\" -m lpsync.cli bench --memory cuda --devices cuda:0 --procs 4 --op allreduce \
        --bytes $sizes --iters 5 --warmup 1 --json > \"$out/allreduce.json\""
    step allreduce_2daemons 40 sh -c "\"$py\" -m lpsync.cli bench --memory cuda --devices cuda:0 --procs 4 \
        --local-nodes 2 --op allreduce --bytes $sizes --iters 5 --warmup 1 --json > \"$out/allreduce_2daemons.json\""
    if "$py" -c "import ucxx" >/dev/null 2>&1; then
        step allreduce_2daemons_direct 40 sh -c "\"$py\" -m lpsync.cli bench --memory cuda --devices cuda:0 --procs 4 \
            --local-nodes 2 --peer-device-path device --op allreduce --bytes $sizes --iters 5 --warmup 1 --json \
            > \"$out/allreduce_2daemons_direct.json\""
    else
        skip allreduce_2daemons_direct "ucxx is not in the image: the direct device path needs UCX's cuda transports"
    fi
    step profile 20 profile cuda:0
    step nccl 30 "$py" -m lab.nccl --sizes "$sizes" --iters 10 --json "$out/nccl.json"
fi

# The table and result.json, whatever happened above.
"$py" - "$out" "$mode" <<'PY'
import json, os, sys, xml.etree.ElementTree as ET
out, mode = sys.argv[1], sys.argv[2]
def load(name):
    path = os.path.join(out, name)
    try:
        return json.load(open(path)) if name.endswith(".json") else ET.parse(path).getroot()
    except (OSError, ValueError, ET.ParseError):
        return None
steps = []
for line in open(os.path.join(out, "steps.tsv")):
    name, rc, millis, limit, *why = line.rstrip("\n").split("\t")
    status = "skipped" if rc == "skip" else "ok" if rc == "0" else "timed out" if rc in ("124", "137") else f"failed (exit {rc})"
    steps.append({"step": name, "status": status, "seconds": round(int(millis) / 1000, 1),
                  "limit_s": int(limit), "why": why[0] if why else ""})
rows, wrong = [], 0
suite = load("junit.xml")
if suite is not None:
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    rows.append(("pytest -m gpu", f"{suite.get('tests')} tests, {suite.get('failures')} failed, "
                 f"{suite.get('errors')} errors, {suite.get('skipped')} skipped"))
pre = load("preflight.json")
if pre is not None:
    rows.append(("preflight", f"{len(pre['problems'])} problems, {pre['gpu_tests']} gpu tests collected"
                 + (f"; refused: {', '.join(pre['refused'])}" if pre["refused"] else "")))
copy = load("copy.json")
if copy is not None:
    ratio = copy["ipc_over_d2d"]
    rows.append(("256 MiB copy, D2D", f"{copy['d2d_gbps']:.1f} GB/s"))
    rows.append(("256 MiB copy, CUDA IPC", f"{copy['ipc_gbps']:.1f} GB/s ({100 * ratio:.0f}% of D2D; "
                 f"target >= 80%: {'met' if ratio >= 0.8 else 'NOT met'})"))
for name, label in (("allreduce.json", "allreduce 4 procs"), ("allreduce_2daemons.json", "allreduce 4 procs on 2 daemons"),
                    ("allreduce_2daemons_direct.json", "allreduce 4 procs on 2 daemons, direct")):
    bench = load(name)
    for row in (bench or {}).get("results", {}).get("lpsync", []):
        wrong += row["wrong"]
        rows.append((f"{label}, {row['size'] / 2**20:g} MiB", f"{row['time_us']:.0f} us, algbw "
                     f"{row['algbw_gbps']:.2f} GB/s, {row.get('algorithm', '')}, #wrong {row['wrong']}"))
nccl = load("nccl.json")
for row in (nccl or {}).get("results", []):
    rows.append((f"allreduce through NCCL, {nccl['world']} GPUs, {row['size'] / 2**20:g} MiB",
                 f"{row['time_us']:.0f} us, algbw {row['algbw_gbps']:.2f} GB/s"))
profile = load("profile.json")
for name, row in (profile or {}).get("steps", {}).items():
    rows.append((f"profile ({profile['devices']}): {name}", f"{row['median_us']:.0f} us median"))
failed = [s for s in steps if s["status"] not in ("ok", "skipped")]
ok = not failed and not wrong
print(f"\n# lpsync GPU check ({mode})")
print("| step | status | seconds (limit) |\n|---|---|---|")
for s in steps:
    print(f"| {s['step']} | {s['status']}{': ' + s['why'] if s['why'] else ''} | {s['seconds']} ({s['limit_s']}) |")
print("\n| check | result |\n|---|---|")
for name, result in rows:
    print(f"| {name} | {result} |")
print(f"\nverdict: {'PASS' if ok else 'FAIL'}; raw results in {out}")
json.dump({"mode": mode, "ok": ok, "wrong": wrong, "steps": steps, "rows": [list(r) for r in rows],
           "profile": profile, "preflight": pre}, open(os.path.join(out, "result.json"), "w"), indent=1)
sys.exit(0 if ok else 1)
PY
