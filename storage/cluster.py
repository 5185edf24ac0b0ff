"""Redis Cluster tier: the Redis tier's key scheme and fault handling on a cluster client.

Every key of one entry carries the hash tag `{<key>}`, so an entry lives in one slot on
one node and its reads and writes are pipelined as on a single server. `urls` are
startup nodes; the client discovers the rest of the cluster from them.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlsplit

from redis.cluster import ClusterNode, RedisCluster

from storage.config import RedisClusterTierConfig
from storage.redis_tier import SOCKET_READ_SIZE, RedisTier, redact


class RedisClusterTier(RedisTier):
    """Tier on a Redis Cluster given by startup node URLs (all with the same credentials)."""

    kind = "redis-cluster"

    def __init__(self, config: RedisClusterTierConfig, *, namespace: str = "") -> None:
        super().__init__(config, namespace=namespace)

    @property
    def target(self) -> str:
        return ",".join(redact(u) for u in self.config.urls)

    def _connect(self) -> Any:
        """Connect to the startup nodes and load the slot map (network I/O; may raise)."""
        cfg: RedisClusterTierConfig = self.config
        nodes, auth = [], {}
        for url in cfg.urls:
            parts = urlsplit(url)
            nodes.append(ClusterNode(parts.hostname or "127.0.0.1", parts.port or 6379))
            if parts.password is not None:
                auth = {"username": unquote(parts.username) if parts.username else None, "password": unquote(parts.password)}
        return RedisCluster(
            startup_nodes=nodes,
            ssl=cfg.urls[0].startswith("rediss://"),
            socket_timeout=cfg.socket_timeout_s,
            socket_connect_timeout=cfg.connect_timeout_s,
            socket_read_size=SOCKET_READ_SIZE,
            max_connections=cfg.pool_size,
            retry=self._retry(),
            **auth,
        )
