"""Compiled CPU kernels (built on first use or at install; torch fallbacks elsewhere)."""
