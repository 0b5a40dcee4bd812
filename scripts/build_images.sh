#!/usr/bin/env bash
# Build lpsync's images without a container registry or a package index reachable from the
# build: a wheelhouse made on the host, a Debian base made by debootstrap, then
# deploy/Dockerfile's targets and a Prometheus image from Debian's package.
# Run from anywhere as root (debootstrap; the Docker engine). --help says more.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: scripts/build_images.sh [options]

Builds, from the repository this script is in, with no registry and no index reachable
from the builds (docs/deploy.md, "Building without a registry"):

  1. deploy/wheelhouse/   every wheel the images need (the project's dependencies, setuptools
                          for its build, torch 2.13.0 CPU and scikit-learn for the trainer),
                          by `pip wheel` on the host; skipped while the inputs are unchanged
  2. lpsync-base:bookworm `debootstrap --variant=minbase bookworm` + python3 and venv, then
                          `docker import`; kept in the engine and reused while present
  3. lpsync:TAG           deploy/Dockerfile, target daemon   } --build-arg WHEELHOUSE=1:
     lpsync-trainer:TAG   deploy/Dockerfile, target trainer  } pip --no-index from (1)
  4. lpsync-prometheus:TAG  Debian's prometheus binary (apt-get download) on the base, for
                          deploy/compose/offline.override.yml (prom/prometheus's place)
  5. lpsync-stage:deps-TAG, lpsync-stage:deps-trainer-TAG keep the layer cache (a change
                          of the source reinstalls only the project); untagged layers of
                          earlier builds of these images (label org.lpsync.image) are pruned

Then:  docker compose -f docker-compose.yml -f deploy/compose/offline.override.yml up

Options:
  --tag TAG         image tag (default: dev, what docker-compose.yml names)
  --base IMAGE      use this base image (Python 3.11 with venv) instead of making one
  --rebuild-base    make the debootstrap base again even when it exists
  --mirror URL      Debian mirror for debootstrap (default: $DEBIAN_MIRROR or
                    http://deb.debian.org/debian)
  --python PY       host interpreter for the wheelhouse; must be CPython 3.11, the base's
                    (default: $PYTHON or python3)
  --only LIST       comma-separated subset of: wheelhouse,base,daemon,trainer,prometheus
  -h, --help        this text

Environment: DOCKER (default docker). Prints each step's wall time.
EOF
}

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TAG=dev
BASE=""
REBUILD_BASE=0
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PY=${PYTHON:-python3}
ONLY=wheelhouse,base,daemon,trainer,prometheus
DOCKER=${DOCKER:-docker}
BASE_IMAGE=lpsync-base:bookworm
# The base's recipe: a change makes a new base (the label is compared).
BASE_PACKAGES=python3,python3-venv
BASE_RECIPE="minbase bookworm $BASE_PACKAGES v1"
TORCH_SPEC=torch==2.13.0  # the one torch the machines hold as a local CPU wheel
TRAINER_SPECS=("$TORCH_SPEC" "scikit-learn>=1.4")

while [ $# -gt 0 ]; do
    case "$1" in
        --tag) TAG=$2; shift 2 ;;
        --base) BASE=$2; shift 2 ;;
        --rebuild-base) REBUILD_BASE=1; shift ;;
        --mirror) MIRROR=$2; shift 2 ;;
        --python) PY=$2; shift 2 ;;
        --only) ONLY=$2; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "build_images.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done

CLEANUP=()
cleanup() { if [ ${#CLEANUP[@]} -gt 0 ]; then rm -rf "${CLEANUP[@]}"; fi; }
trap cleanup EXIT
wants() { [[ ",$ONLY," == *",$1,"* ]]; }
step_start=0
step() { step_start=$SECONDS; echo "== $*"; }
done_step() { echo "   done in $((SECONDS - step_start)) s"; }

WHEELHOUSE="$ROOT/deploy/wheelhouse"

make_wheelhouse() {
    step "wheelhouse: $WHEELHOUSE"
    local version stamp inputs
    version=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    if [ "$version" != 3.11 ]; then
        echo "build_images.sh: $PY is Python $version; the images run 3.11 (bookworm): pass --python" >&2
        exit 1
    fi
    # What decides the wheels: both distributions' requirements and the trainer's.
    inputs=$("$PY" -c 'import sys, tomllib
for path in sys.argv[1:]:
    with open(path, "rb") as f:
        data = tomllib.load(f)
    print(data["build-system"]["requires"], data["project"]["dependencies"])' \
        "$ROOT/pyproject.toml" "$ROOT/clients/python/pyproject.toml"; echo "${TRAINER_SPECS[*]}")
    stamp=$(printf '%s' "$inputs" | sha256sum | cut -c1-16)
    if [ -f "$WHEELHOUSE/.stamp" ] && [ "$(cat "$WHEELHOUSE/.stamp")" = "$stamp" ]; then
        echo "   up to date (inputs unchanged: $stamp)"
        return
    fi
    # pip wheel, not download: anything published only as an sdist is built here, once.
    nice "$PY" -m pip wheel -q --wheel-dir "$WHEELHOUSE" \
        "$ROOT" "$ROOT/clients/python" "setuptools>=77" "${TRAINER_SPECS[@]}" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
    # The project itself is built from source inside the image; no stale copy of it here.
    rm -f "$WHEELHOUSE"/lpsync-*.whl "$WHEELHOUSE"/lpsync_client-*.whl
    echo "$stamp" > "$WHEELHOUSE/.stamp"
    echo "   $(find "$WHEELHOUSE" -name '*.whl' | wc -l) wheels, $(du -sh "$WHEELHOUSE" | cut -f1)"
    done_step
}

# The project's two wheels, built on the host every time (the source changes): the daemon's
# carries the native engine (lpsync/native, compiled by the host's C compiler; the images'
# minbase has none, and the host is Debian bookworm with CPython 3.11 as they are). The
# Dockerfile installs these where present (deploy/dist), else builds them inside.
make_project_wheels() {
    step "the project's wheels (deploy/dist, the native engine compiled here)"
    rm -f "$ROOT"/deploy/dist/*.whl
    PIP_FIND_LINKS="$WHEELHOUSE" nice "$PY" -m pip wheel -q --no-deps --wheel-dir "$ROOT/deploy/dist" \
        "$ROOT" "$ROOT/clients/python" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
    if ! "$PY" -m zipfile -l "$ROOT"/deploy/dist/lpsync-[0-9]*.whl | grep -q 'lpsync/native/_engine'; then
        echo "build_images.sh: the lpsync wheel has no native engine (no C compiler?): the images" \
             "run every collective on the Python path" >&2
    fi
    done_step
}

make_base() {
    if [ -n "$BASE" ]; then
        echo "== base: $BASE (given)"
        return
    fi
    BASE=$BASE_IMAGE
    step "base: $BASE_IMAGE"
    local have=""
    have=$($DOCKER image inspect --format '{{ index .Config.Labels "org.lpsync.base-recipe" }}' \
        "$BASE_IMAGE" 2>/dev/null || true)
    if [ "$REBUILD_BASE" = 0 ] && [ "$have" = "$BASE_RECIPE" ]; then
        echo "   cached in the engine ($BASE_RECIPE)"
        return
    fi
    command -v debootstrap >/dev/null || {
        echo "build_images.sh: debootstrap is missing (apt-get install debootstrap)" >&2
        exit 1
    }
    local root
    root=$(mktemp -d /tmp/lpsync-base.XXXXXX)
    CLEANUP+=("$root" "$root.log")
    nice debootstrap --variant=minbase --include="$BASE_PACKAGES" bookworm "$root" "$MIRROR" \
        > "$root.log" 2>&1 || { tail -20 "$root.log" >&2; exit 1; }
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/tmp/*
    tar -C "$root" -c . | $DOCKER import \
        --change "LABEL org.lpsync.base-recipe=\"$BASE_RECIPE\"" \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
        --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
    done_step
}

build_target() {  # stage that builds the venv, target, image name
    step "image $3:$TAG (deploy/Dockerfile, target $2)"
    local stage
    # The stage that installs is tagged too (lpsync-stage:NAME-TAG): the legacy builder's
    # cache is its chain of layers, which the pruning below must keep.
    for stage in "$1" "$2"; do
        local name="$3:$TAG"
        [ "$stage" = "$2" ] || name="lpsync-stage:$stage-$TAG"
        $DOCKER build -q --force-rm -f "$ROOT/deploy/Dockerfile" --target "$stage" \
            --build-arg PYTHON_IMAGE="$BASE" --build-arg WHEELHOUSE=1 \
            -t "$name" "$ROOT" 2> >(grep -v -e DEPRECATED -e buildx -e '^ *$' >&2) >/dev/null
    done
    done_step
}

prune() {
    # Superseded layers of earlier builds of these images (untagged now), and only those.
    step "removing superseded layers of earlier builds"
    $DOCKER image prune -f --filter label=org.lpsync.image >/dev/null
    done_step
}

build_prometheus() {
    step "image lpsync-prometheus:$TAG (Debian's prometheus on $BASE)"
    local context
    context=$(mktemp -d /tmp/lpsync-prometheus.XXXXXX)
    CLEANUP+=("$context")
    (cd "$context" && apt-get download -q prometheus >/dev/null 2>&1) || {
        echo "build_images.sh: apt-get download prometheus failed (apt-get update first?)" >&2
        exit 1
    }
    dpkg-deb -x "$context"/prometheus_*.deb "$context/root"
    cp "$context/root/usr/bin/prometheus" "$context/prometheus"
    cp "$ROOT/deploy/compose/prometheus.Dockerfile" "$context/Dockerfile"
    $DOCKER build -q --force-rm --build-arg BASE_IMAGE="$BASE" -t "lpsync-prometheus:$TAG" "$context" \
        2> >(grep -v -e DEPRECATED -e buildx -e '^ *$' >&2) >/dev/null
    done_step
}

total=$SECONDS
if wants wheelhouse; then make_wheelhouse; fi
if wants daemon || wants trainer; then make_project_wheels; fi
if wants base || wants daemon || wants trainer || wants prometheus; then make_base; fi
if wants daemon; then build_target deps daemon lpsync; fi
if wants trainer; then build_target deps-trainer trainer lpsync-trainer; fi
if wants prometheus; then build_prometheus; fi
prune
echo "== images built in $((SECONDS - total)) s"
