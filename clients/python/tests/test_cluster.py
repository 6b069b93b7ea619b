"""Redis Cluster (three primaries) through redis-py's cluster clients, blocking and
asyncio: hash-tagged pairs by the module, and without the module by the script,
loaded where it runs."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any, Callable, List

import pytest
import redis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster

from conftest import Server
from qag_client import TOKEN_BUCKET_LUA, AsyncLimiter, Bucket, Limiter, bucket_key


def owner(nodes: List[Server], key: str) -> Server:
    for node in nodes:
        try:
            if node.client().exists(key):
                return node
        except redis.exceptions.ResponseError:  # MOVED
            pass
    raise AssertionError(f"no node holds {key}")


def scenario(
    nodes: List[Server], take_pair: Callable[..., Any], take: Callable[..., Any], backend: str
) -> None:
    used = set()
    for tenant in range(12):
        tag = f"tenant{tenant}"
        client = bucket_key("ip", 2, 60, "203.0.113.9", tag)
        key = bucket_key("key", 60, 60, "partner", tag)
        for n in range(3):
            pair = take_pair(Bucket(client, 2, 60), Bucket(key, 60, 60))
            assert pair.answered_by == backend
            assert pair.allowed == (n < 2), (client, n)
        node = owner(nodes, key)
        used.add(node.port)
        if backend == "script":
            raw = node.client()
            sha = hashlib.sha1(TOKEN_BUCKET_LUA.encode()).hexdigest()
            raw.script_flush()
            assert raw.script_exists(sha) == [False]
            # Flushed on the owner: the next call loads it there again.
            assert take(Bucket(client, 2, 60)).answered_by == "script"
            assert raw.script_exists(sha) == [True]
    assert len(used) == 3, "the tags spread over every node"


@pytest.mark.parametrize("with_module", [True, False])
def test_tagged_pairs_through_the_cluster_client(
    start_cluster: Callable[..., List[Server]], with_module: bool
) -> None:
    nodes = start_cluster(with_module=with_module)
    limiter = Limiter(RedisCluster(host="127.0.0.1", port=nodes[0].port))
    backend = "module" if with_module else "script"
    scenario(nodes, limiter.take_pair, limiter.take, backend)


@pytest.mark.parametrize("with_module", [True, False])
def test_tagged_pairs_through_the_async_cluster_client(
    start_cluster: Callable[..., List[Server]], with_module: bool
) -> None:
    nodes = start_cluster(with_module=with_module)
    loop = asyncio.new_event_loop()

    async def make() -> AsyncLimiter:
        return AsyncLimiter(AsyncRedisCluster(host="127.0.0.1", port=nodes[0].port))

    limiter = loop.run_until_complete(make())

    def blocking(method: Callable[..., Any]) -> Callable[..., Any]:
        return lambda *args: loop.run_until_complete(method(*args))

    try:
        backend = "module" if with_module else "script"
        scenario(nodes, blocking(limiter.take_pair), blocking(limiter.take), backend)
    finally:
        loop.run_until_complete(limiter._client.aclose())
        loop.close()
