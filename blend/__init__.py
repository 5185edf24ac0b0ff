"""kvblend engine: model loading, the layerwise runner, CacheBlend and the CLI."""
