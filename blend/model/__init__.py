"""The model and how it runs: loading (aliases, GGUF conversion, random shapes, dims), the layerwise
runner with explicit positions, its KV cache, and exact attention of arbitrary query rows.
"""
