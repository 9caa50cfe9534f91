#!/bin/sh
# Regenerate the *_pb2.py / *_pb2_grpc.py stubs from dra.proto, dra_v1beta1.proto and registration.proto with
# grpcio-tools (pip install 'grpcio-tools>=1.85.1'), as src/gpuhook/plugin/regen.sh does for the device plugin.
# Run from anywhere; uses the project's venv python unless $PYTHON is set. Generated from the src/ root so the
# stubs import each other as `gpuhook.dra.dra_pb2`.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "$here/../.." && pwd)
python=${PYTHON:-"$src/../.venv/bin/python"}
cd "$src"
"$python" -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. \
    gpuhook/dra/dra.proto gpuhook/dra/dra_v1beta1.proto gpuhook/dra/registration.proto
grep -m1 'Protobuf Python Version' gpuhook/dra/dra_pb2.py
grep -m1 'GRPC_GENERATED_VERSION =' gpuhook/dra/dra_pb2_grpc.py
