"""Clients for nanoplane's public gRPC API; they import `proto` and grpc only."""

from .client import AsyncClient, BatchProgress, Chunk, Client, Completion, Usage, build_request

__all__ = ["AsyncClient", "BatchProgress", "Chunk", "Client", "Completion", "Usage", "build_request"]
