"""Helpers for the tests and benchmarks, not used by the product: tiny HF models (tiny_hf.py) and the conversion
round-trip proofs (conversion.py).
"""
