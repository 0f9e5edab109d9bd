"""The real SGLang server and sglang-router on CPU, for tests (see README.md here)."""
