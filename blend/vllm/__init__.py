"""kvblend inside vLLM: a KV connector (connector.py), vLLM blocks <-> entries (layout.py)."""
