"""Benchmarks: `kvblend bench load | ttft | resume`. Timing only; speed goals live here,
never in tests. Shared hygiene (page-cache dropping, one-tier stores) is in `common`."""
