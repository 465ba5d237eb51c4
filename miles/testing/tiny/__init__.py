"""Tiny random-weight pipeline builders, one module per family (see miles/testing/make_tiny.py)."""
