"""Kernels of the LLM custom ops (`llama::*`), which pass the KV cache in place."""
