//! A gateway's client for qag.
//!
//! [`Limiter`] calls the module's QAG.* commands where the server has them and, for
//! token buckets, the repository's `lua/token_bucket.lua` where it does not (the same
//! keys and replies, so a budget is never split or doubled), turns replies into typed
//! decisions, holds concurrency slots with self-renewing [`LeaseGuard`]s, and renders
//! [`headers`] for a response. Decisions, header rendering and local counting are plain
//! code ([`decision`], [`headers`], [`local`], [`naming`]); [`Limiter`] is the thin
//! layer that talks to Redis through any `redis::aio::ConnectionLike`.

pub mod decision;
mod error;
pub mod headers;
mod lease;
mod limiter;
pub mod local;
pub mod naming;

pub use decision::{
    Admission, AnsweredBy, Bucket, Decision, LeaseRefusal, PairDecision, Per, Quota, QuotaDecision,
    QuotaUsage, Scope,
};
pub use error::Error;
pub use headers::headers;
pub use lease::{Lease, LeaseGuard};
pub use limiter::{Backend, Limiter, OnUnavailable, Options, TOKEN_BUCKET_LUA};
pub use naming::bucket_key;
