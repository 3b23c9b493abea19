"""Generated gRPC stubs for the tltd.v1 API (do not edit: `make stubs` regenerates them)."""
