"""Public gRPC API of nanoplane, by version; generated modules live beside their .proto files."""
