"""A control plane's use of qag_client: both buckets of a request, the headers to
send, a slot held for a query's length, a quota checked before and added after.
Run: python examples/gateway.py redis://127.0.0.1:6379/"""

import sys

import redis

from qag_client import Limiter, QagRefused, QagUnavailable, bucket_key, headers

url = sys.argv[1] if len(sys.argv) > 1 else "redis://127.0.0.1:6379/"
client = redis.Redis.from_url(url)
# While Redis fails, count in this process for 5 s at a time instead of raising.
limiter = Limiter(client, on_unavailable="local")


def handle(api_key: str, client_ip: str, request_id: str) -> int:
    # One hash tag per API key keeps both buckets in one cluster slot.
    per_ip = bucket_key("ip", 10, 1, client_ip, api_key)
    per_key = bucket_key("key", 60, 60, api_key, api_key)
    pair = limiter.take_pair(per_ip, 10, 1, per_key, 60, 60)
    quota_key = f"qag:quota:{api_key}"
    quota = limiter.quota_check(quota_key, "month", "Europe/Berlin", calls=100_000)
    fields = headers(client=pair.client, key=pair.key, quota=quota)
    print(fields)
    if not pair.allowed or not quota.allowed:
        return 429
    try:
        with limiter.lease(f"qag:running:{api_key}", 4, 30_000, request_id) as lease:
            rows = 250  # the query runs here; the lease is renewed meanwhile
            if lease.lost:
                print("the slot ran out during the query")
    except QagRefused:
        return 429  # too_many_concurrent, Retry-After: 1
    limiter.quota_add(quota_key, "month", "Europe/Berlin", calls=1, rows=rows)
    return 200


try:
    print(handle("acme", "203.0.113.9", "req-1"))
except QagUnavailable as error:  # quotas and leases have no local rule
    print(503, error)
