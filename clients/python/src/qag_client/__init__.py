"""A gateway's client for qag (redis-py, blocking and asyncio).

``Limiter`` / ``AsyncLimiter`` call the module's QAG.* commands where the server has
them and, where it does not, scripts for every family (token buckets, leases, quotas,
windows; the token bucket's is the repository's ``lua/token_bucket.lua``): the same
keys, fields and replies as the module and the Rust client (qag-client), so a budget is
never split or doubled. When Redis fails, one policy for every family ("raise",
"forward" or "local") with a back-off that ends by itself: a prober in the background
probes Redis until it answers. Decisions, the policy,
header rendering and local counting are plain code (``decisions``, ``_engine``,
``_policy``, ``headers``, ``local``, ``naming``); both limiters are one driver
(``_driver``), performed with blocking calls (``_sync``) or awaits (``_async``).
"""

from ._async import AsyncLease, AsyncLimiter, AsyncReservation
from ._script import (
    TOKEN_BUCKET_IDS_LUA,
    TOKEN_BUCKET_LUA,
    TOKEN_REFUND_IDS_LUA,
    TOKEN_REFUND_LUA,
)
from ._sync import Lease, Limiter, Reservation
from .decisions import (
    Admission,
    Counts,
    Decision,
    PairDecision,
    QagBusy,
    QagCrossSlot,
    QagError,
    QagModuleRequired,
    QagPermissionError,
    QagRefused,
    QagServerError,
    QagUnavailable,
    Quota,
    QuotaDecision,
    QuotaUsage,
    Refunded,
    Scope,
    TakenWithQuota,
)
from .headers import headers
from .naming import Bucket, bucket_key

__all__ = [
    "Admission",
    "AsyncLease",
    "AsyncLimiter",
    "AsyncReservation",
    "Bucket",
    "Counts",
    "Decision",
    "Lease",
    "Limiter",
    "PairDecision",
    "QagBusy",
    "QagCrossSlot",
    "QagError",
    "QagModuleRequired",
    "QagPermissionError",
    "QagRefused",
    "QagServerError",
    "QagUnavailable",
    "Quota",
    "QuotaDecision",
    "QuotaUsage",
    "Refunded",
    "Reservation",
    "Scope",
    "TOKEN_BUCKET_IDS_LUA",
    "TOKEN_BUCKET_LUA",
    "TOKEN_REFUND_IDS_LUA",
    "TOKEN_REFUND_LUA",
    "TakenWithQuota",
    "bucket_key",
    "headers",
]
