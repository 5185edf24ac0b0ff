"""Chat sessions: history files, device-resident KV, offload and resume from prefix blocks.
"""
