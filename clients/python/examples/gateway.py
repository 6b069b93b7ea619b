"""A gateway's use of qag_client: both buckets of a request, a window of model
tokens, a quota checked before and added after, a slot held for the query's length,
and the header fields to send. Run: python examples/gateway.py redis://127.0.0.1:6379/"""

import sys
from typing import List, Tuple

import redis

from qag_client import Bucket, Limiter, QagBusy, QagRefused, Quota, headers

Fields = List[Tuple[str, str]]


# A quota described once, for its check and its add.
MONTHLY = Quota("month", "Europe/Berlin", calls=100_000)


def buckets(address: str, workspace: str, name: str) -> Tuple[Bucket, Bucket]:
    # The address's own bucket, across every key it uses, and the key's: no hash tag
    # in common (in a cluster they are two calls, see docs/clients.md#redis-cluster).
    return (
        Bucket.named("client", 20, 1, address),  # qag:ratelimit:client:20/1:203.0.113.9
        Bucket.named("key", 100, 60, f"{workspace}~{name}"),  # ...:key:100/60:acme~partner
    )


def handle(
    limiter: Limiter, address: str, workspace: str, name: str, request_id: str
) -> Tuple[int, Fields]:
    per_client, per_key = buckets(address, workspace, name)
    pair = limiter.take_pair(per_client, per_key)
    quota_key = f"qag:quota:{workspace}~{name}"
    quota = limiter.quota_check(quota_key, MONTHLY)
    if not (pair.allowed and quota.allowed):
        return 429, headers(pair.client, pair.key, quota)
    # Requests and model tokens a minute, for the workspace and the key at once (one
    # hash tag: one cluster slot).
    scopes = [
        (f"qag:win:{{{workspace}}}:org", 1000, 0),
        (f"qag:win:{{{workspace}}}:{name}", 60, 100_000),
    ]
    admission = limiter.admit(scopes)
    if not admission.admitted:
        return 429, [("retry-after", str(admission.retry_after))]
    try:
        with limiter.lease(f"qag:running:{workspace}~{name}", 4, 30_000, request_id) as lease:
            rows, tokens = 250, 1834  # the query runs here; the lease is renewed meanwhile
            if lease.lost:
                print("the slot ran out during the query")
    except QagRefused as refused:  # too_many_concurrent
        return 429, headers(pair.client, pair.key, quota, refused)
    limiter.record([key for key, _, _ in scopes], tokens)
    usage = limiter.quota_add(quota_key, MONTHLY, calls=1, rows=rows)
    # Rendered from the count after this call: the last call allowed says 0 left.
    return 200, headers(pair.client, pair.key, quota.after(usage))


def main(url: str) -> None:
    # While Redis fails: count in this process (one of 2 gateway processes: half of
    # every limit) for 5 s at a time, then let one call try Redis again.
    limiter = Limiter(
        redis.Redis.from_url(url),
        on_unavailable="local",
        back_off=5.0,
        local_share=0.5,
        max_connections=50,  # the calls in flight at once in this process
    )
    try:
        status, fields = handle(limiter, "203.0.113.9", "acme", "partner", "req-1")
    except QagBusy:  # more calls in flight than max_connections, for a whole deadline
        status, fields = 503, []
    print(status, fields)
    print(limiter.counts)
    limiter.close()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "redis://127.0.0.1:6379/")
