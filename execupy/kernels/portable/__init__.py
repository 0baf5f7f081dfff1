"""Portable numpy kernels, one file per operator family (see kernels/registry.py for the calling convention)."""
