"""The HTTP door (off by default): OpenAI-compatible completions and SGLang-compatible endpoints
over the same services, auth, TLS and errors as the gRPC API (docs/http.md)."""
