"""Decoding: sampling, batched decode steps, incremental text with stop strings, the result of a
generation.
"""
