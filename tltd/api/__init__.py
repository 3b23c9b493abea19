"""gRPC transport: the proto<->domain converter, thin servicers, interceptors and the server."""
