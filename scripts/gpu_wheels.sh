#!/usr/bin/env bash
# Wheels a GPU machine without network needs beside its image's own packages
# (docs/gpu.md, "The GPU check"): run on a machine with network, for the GPU machine's
# Python (3.12 by default); scripts/gpu_check.sh installs them there with pip --no-index.
#   scripts/gpu_wheels.sh                 # into .gpu-wheels/ (git-ignored)
# Env: GPU_WHEELS_DIR (default .gpu-wheels), GPU_WHEELS_PYTHON (default 3.12),
#      GPU_WHEELS_ARCH (default x86_64; aarch64 for Grace machines: GH200, GB200).
# The image is expected to hold numpy, ml_dtypes, cupy, prometheus-client and pytest; what
# it lacks or holds too old is the gRPC stack: the generated code in clients/python/lpsync_client/wire/proto names
# the grpcio and protobuf it needs at least, and those versions are fetched (the list
# below is GPU_CHECK_WHEEL_PACKAGES in gpu_check.sh: tests/test_gpu_preflight.py).
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${GPU_WHEELS_DIR:-.gpu-wheels}
version=${GPU_WHEELS_PYTHON:-3.12}
arch=${GPU_WHEELS_ARCH:-x86_64}

grpc=$(sed -n "s/^GRPC_GENERATED_VERSION = '\(.*\)'/\1/p" clients/python/lpsync_client/wire/proto/lpsync_pb2_grpc.py)
protobuf=$(sed -n 's/^# Protobuf Python Version: \(.*\)/\1/p' clients/python/lpsync_client/wire/proto/lpsync_pb2.py)
[ -n "$grpc" ] && [ -n "$protobuf" ] || { echo "gpu_wheels: cannot read the versions from clients/python/lpsync_client/wire/proto" >&2; exit 1; }

mkdir -p "$dest"
platforms=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014; do
    p="${p}_$arch"
    platforms+=(--platform "$p")
done
for spec in "grpcio==$grpc" "grpcio-health-checking==$grpc" "grpcio-reflection==$grpc" "protobuf==$protobuf"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$version" \
        --implementation cp "${platforms[@]}" -d "$dest" "$spec"
done
ls -1 "$dest"
echo "gpu_wheels: $(du -sh "$dest" | cut -f1) in $dest; carry it to the GPU machine with the checkout"
