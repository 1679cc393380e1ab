"""Kernel families: each folder holds a reference (the semantics) beside its fast providers."""
