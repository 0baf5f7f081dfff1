"""Ahead-of-time compiler: capture, edge dialect, passes, memory planning, emit (needs torch)."""
