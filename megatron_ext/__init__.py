"""Megatron-Core integration of per-dtype gradient buffers (work in progress)."""
