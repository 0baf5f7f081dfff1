"""Delegate backends. Each backend's runtime half registers itself here when imported."""
