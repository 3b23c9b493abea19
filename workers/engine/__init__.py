"""The torch rollout engine: continuous batching, KV cache, lossless speculative decoding."""
