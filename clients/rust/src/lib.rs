//! A gateway's client for qag.
//!
//! [`Limiter`] calls the module's QAG.* commands where the server has them and the
//! repository's scripts (`lua/`: token buckets, leases, quotas, windows) where it does
//! not (the same keys and replies, so a budget is never split or doubled), turns replies into typed
//! decisions, holds concurrency slots with self-renewing [`LeaseGuard`]s, answers by its
//! [`OnUnavailable`] policy when Redis fails (with one timeout per back-off), and renders
//! [`Headers`] for a response. Decisions, header rendering, the outage policy and local
//! counting are plain code ([`decision`], [`headers`], [`local`], [`naming`], `policy`);
//! [`Limiter`] is the thin layer that talks to Redis through any
//! `redis::aio::ConnectionLike`, one file per command family.

pub mod answers;
mod bounded;
mod buckets;
mod cluster;
pub mod decision;
mod error;
pub mod headers;
mod ids;
mod leases;
mod limiter;
pub mod local;
mod mutex;
pub mod naming;
mod nodes;
mod policy;
mod quotas;
mod reservations;
#[cfg(feature = "tower")]
pub mod tower;
mod waiting;
mod windows;

pub use decision::{
    Admission, AnsweredBy, Decision, LeaseRefusal, PairDecision, Per, Quota, QuotaDecision,
    QuotaUsage, Recorded, Refunded, RetryAfter, Scope, Side, TakenWithQuota,
};
pub use error::{Error, Reason};
pub use headers::Headers;
pub use ids::new_request_id;
pub use leases::{Lease, LeaseGuard};
pub use limiter::{
    Backend, CrossSlot, Limiter, Options, LEASE_LUA, QUOTA_LUA, TOKEN_BUCKET_IDS_LUA,
    TOKEN_BUCKET_LUA, TOKEN_REFUND_IDS_LUA, TOKEN_REFUND_LUA, WINDOW_LUA,
};
pub use naming::{bucket_key, Bucket};
pub use nodes::ClusterNodes;
pub use policy::{Counts, OnUnavailable};
pub use reservations::Reservation;
