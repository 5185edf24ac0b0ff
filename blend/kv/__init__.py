"""Cached KV: a document's or a prefix's KV as store entries (computing them on a miss), and the
loader that places stored layers into a request's cache, re-rotated to its positions.
"""
