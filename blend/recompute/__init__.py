"""CacheBlend's selective recompute: which rows each layer computes (the plan), scoring and
selecting them, the stale-K/V corrections, and the layer loop over the loaded KV.
"""
