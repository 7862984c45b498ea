"""Benchmarks: norm/clip speed and gradient-buffer memory, each with its own ceilings."""
