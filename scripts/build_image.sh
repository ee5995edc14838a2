#!/usr/bin/env bash
# `make image`: builds one target of ./Containerfile with podman (IMAGE_TARGET: cpu, cuda12, tpu)
# and tags it IMAGE (default localhost/estimax:$IMAGE_TARGET).
#
# The base: IMAGE_BASE if given (a registry image, e.g. docker.io/library/python:3.11-slim-bookworm);
# else localhost/estimax-base:bookworm, made once from the Debian mirror this machine's apt uses
# (mmdebstrap --variant=minbase bookworm; no registry needed).
# The package index is this machine's pip's: PIP_INDEX_URL, PIP_EXTRA_INDEX_URL and
# PIP_FIND_LINKS from the environment, else from `pip config` (a file:// index is mounted into
# the build read-only at its own path), and pip's CA bundle (PIP_CERT, pip's `cert`, else
# SSL_CERT_FILE) is given to the build as a secret: read by pip, never written into the image.
# PODMAN: the podman command, with the options these machines need (docs/install.md).
set -euo pipefail

TARGET=${IMAGE_TARGET:-cpu}
IMAGE=${IMAGE:-localhost/estimax:$TARGET}
PODMAN=${PODMAN:-podman}
PIP_PY=${PIP_PY:-python3}
BASE=${IMAGE_BASE:-}
WORK=${IMAGE_WORK:-runs/image}

pip_config() {  # the value pip itself would use for $1 (config key), or nothing
    "$PIP_PY" -m pip config get "global.$1" 2>/dev/null || true
}

if [ -z "$BASE" ]; then
    BASE=localhost/estimax-base:bookworm
    # `image exists`: 0 yes, 1 no, anything else podman's own error (stop on it, not rebuild).
    found=0
    $PODMAN image exists "$BASE" || found=$?
    if [ "$found" -gt 1 ]; then
        echo "make image: podman failed ($found) checking for $BASE: see its message above" >&2
        exit 1
    fi
    if [ "$found" = 1 ]; then
        command -v mmdebstrap >/dev/null || {
            echo "make image: no base image $BASE and no mmdebstrap to make one from the Debian" \
                "mirror: apt-get install -y mmdebstrap, or give IMAGE_BASE=<a registry image>" >&2
            exit 1
        }
        mkdir -p "$WORK"
        echo "make image: building $BASE from the Debian mirror (mmdebstrap, about a minute)"
        mmdebstrap --quiet --variant=minbase bookworm "$WORK/rootfs.tar"
        $PODMAN import "$WORK/rootfs.tar" "$BASE" >/dev/null
        rm -f "$WORK/rootfs.tar"
    fi
fi

index=${PIP_INDEX_URL:-$(pip_config index-url)}
extra=${PIP_EXTRA_INDEX_URL:-$(pip_config extra-index-url)}
links=${PIP_FIND_LINKS:-$(pip_config find-links)}
cert=${PIP_CERT:-$(pip_config cert)}
cert=${cert:-${SSL_CERT_FILE:-}}

args=(--build-arg "BASE=$BASE")
[ -n "$index" ] && args+=(--build-arg "PIP_INDEX_URL=$index")
[ -n "$extra" ] && args+=(--build-arg "PIP_EXTRA_INDEX_URL=$extra")
[ -n "$links" ] && args+=(--build-arg "PIP_FIND_LINKS=$links")
# A file:// index's pages link to ../../files/...: mount the folder above it; find-links itself.
for url in $index $extra; do
    case $url in file://*) path=$(dirname "${url#file://}") ;; *) continue ;; esac
    if [ -d "$path" ]; then args+=(-v "$path:$path:ro"); fi
done
for url in $links; do
    path=${url#file://}
    if [ -d "$path" ]; then args+=(-v "$path:$path:ro"); fi
done
if [ -n "$cert" ] && [ -f "$cert" ]; then args+=(--secret "id=pip_ca,src=$cert"); fi

echo "make image: $IMAGE (target $TARGET, base $BASE)"
start=$(date +%s)
$PODMAN build --network=host --ulimit nofile=20000:20000 --ulimit nproc=32768:32768 \
    -f Containerfile --target "$TARGET" -t "$IMAGE" "${args[@]}" .
size=$($PODMAN image inspect --format '{{.Size}}' "$IMAGE")
echo "make image: built $IMAGE in $(($(date +%s) - start)) s: $((size / 1000000)) MB"
