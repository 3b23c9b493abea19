"""The SGLang backend: translation to and from `sglang.Engine` (sglang is imported lazily)."""
