"""nanoplane's Python client, installed alone (`pip install nanoplane-client`, built from clients/).

    from nanoplane_client import Client
    from nanoplane_client.proto.nanoplane.v1 import generation_pb2  # the messages, for a stub of your own

The same code as the server distribution's `nanoplane.clients`, under a name of its own.
"""

from .clients import AsyncClient, BatchProgress, Chunk, Client, Completion, Usage, build_request

__all__ = ["AsyncClient", "BatchProgress", "Chunk", "Client", "Completion", "Usage", "build_request"]
