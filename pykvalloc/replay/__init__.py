"""Replaying LLM-serving traffic through the real allocator: trace readers, the embedded default
workload, the continuous-batching simulation and its report."""
