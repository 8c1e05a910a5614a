"""Helpers the tests share: tiny checkpoints, a gRPC server thread, kernel checks, docker config."""
