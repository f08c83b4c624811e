#!/usr/bin/env bash
# Regenerates router/proto/epcluster_pb2.py, epcluster_pb2_grpc.py and epcluster_pb2.pyi from
# epcluster.proto. Usage: router/proto/generate.sh [OUT_ROOT]   (default: the repository root;
# files land in OUT_ROOT/router/proto/). PYTHON picks the interpreter (default: python3).
#
# NOTE: protoc runs with the repository root as its include path, so the descriptor is named
# router/proto/epcluster.proto and the grpc module imports `from router.proto import
# epcluster_pb2`: package-relative with no post-editing. The grpcio-tools version is stamped into
# the files (and sets the minimum grpcio/protobuf at runtime): regenerate with the pinned one.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${1:-$root}"
mkdir -p "$out"
cd "$root"
"${PYTHON:-python3}" -m grpc_tools.protoc -I . \
    --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
    router/proto/epcluster.proto
# The stub file is generated code in protoc's style: keep ruff's linter and formatter off it.
pyi="$out/router/proto/epcluster_pb2.pyi"
{ printf '# ruff: noqa\n# fmt: off\n'; cat "$pyi"; } > "$pyi.tmp"
mv "$pyi.tmp" "$pyi"
