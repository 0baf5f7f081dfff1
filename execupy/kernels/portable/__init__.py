"""Portable numpy kernels, one file per operator family (see runtime/registry.py for the calling convention)."""
