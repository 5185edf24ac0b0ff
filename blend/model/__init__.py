"""The model and how it runs: loading (aliases, GGUF conversion, random shapes, dims), the layerwise
runner with explicit positions, its KV cache, and exact attention of arbitrary query rows.
"""

from blend.model.mkl import request

request()  # before MKL's first call: float32 products whose rows do not depend on their batch (blend.model.mkl)
