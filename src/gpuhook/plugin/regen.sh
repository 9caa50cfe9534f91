#!/bin/sh
# Regenerate api_pb2.py / api_pb2_grpc.py from api.proto with grpcio-tools (pip install 'grpcio-tools>=1.85.1').
# Run from anywhere; uses the project's venv python unless $PYTHON is set. Generated from the src/ root so the
# stubs import each other as `gpuhook.plugin.api_pb2`. The header of api_pb2.py names the protobuf version
# the code needs at run time (ValidateProtobufRuntimeVersion): keep pyproject's protobuf pin at or above it.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "$here/../.." && pwd)
python=${PYTHON:-"$src/../.venv/bin/python"}
cd "$src"
"$python" -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. gpuhook/plugin/api.proto
grep -m1 'Protobuf Python Version' gpuhook/plugin/api_pb2.py
grep -m1 'GRPC_GENERATED_VERSION =' gpuhook/plugin/api_pb2_grpc.py
