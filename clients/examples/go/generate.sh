#!/bin/sh
# Generates the Go code for nanoplane.v1 into ./nanoplanev1. Needs protoc and the two Go plugins on PATH:
#   go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.6
#   go install google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.5.1
# The .proto's go_package names the import path of a published module; the M options map the file
# into this example's own module instead (drop them to generate under go_package's path).
set -eu
cd "$(dirname "$0")"
PROTO_ROOT=${PROTO_ROOT:-../../../proto}
MAP=Mnanoplane/v1/generation.proto=nanoplane-example/nanoplanev1
protoc -I "$PROTO_ROOT" \
  --go_out=. --go_opt=module=nanoplane-example --go_opt="$MAP" \
  --go-grpc_out=. --go-grpc_opt=module=nanoplane-example --go-grpc_opt="$MAP" \
  nanoplane/v1/generation.proto
