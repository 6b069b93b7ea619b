//! A `tower::Layer` that limits every request as ADR 0032 and ADR 0011 say, for axum,
//! hyper 1.x (through hyper-util's tower adapter) and any tower stack (feature `tower`):
//!
//! 1. the client's bucket, keyed by the caller's address: a refusal answers 429
//!    `rate_limited` and the key's bucket is not touched;
//! 2. the key's bucket: 429 `rate_limited` ("for this API key"), the client's token given
//!    back;
//! 3. the key's quota: 429 `quota_exceeded`, naming what ran out and when it resets;
//! 4. the key's concurrency slot: 429 `too_many_concurrent` with `retry-after: 1`;
//! 5. a window chain, for a model API ([`RateLimitLayer::window_limit`]): the request's
//!    estimate of tokens held on every scope (QAG.ADMIT … RESERVE), 429 `rate_limited`
//!    naming `requests` or `tokens` and the window's `retry-after`.
//!
//! The buckets and the quota's check go in one round trip where they can share one
//! ([`Limiter::take_with_quota`]), so a bucket's refusal shows the quota too. A later
//! refusal gives back what earlier steps took (QAG.REFUND), so a request refused by its
//! quota or its slot costs no tokens. An admitted request holds its slot until the
//! response body's last byte (a stream keeps it while it streams) and frees it when the
//! body is dropped early (a client that went away); its call is added to the quota when
//! the handler has answered, with the rows it reported through [`ReportRows`]. A window
//! chain's hold ([`TokenHold`]) is charged by the handler as it streams and committed
//! with the actual count; what the handler left uncommitted is committed (what it
//! charged) at the body's end, so the hold does not outlive the response. Every response
//! to a limited caller carries the headers of what was counted (a window chain's as
//! OpenAI's `x-ratelimit-*-requests` and `-tokens`); the handler finds the decisions in
//! the [`Admitted`] extension.
//!
//! A limit in shadow ([`RateLimitLayer::shadow`]) is asked and counted as usual, but
//! its refusals are let through: logged (a line a second at most) and counted in
//! [`RateLimitLayer::limit_counts`], never answered 429.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use redis::aio::ConnectionLike;
use tokio::task::JoinHandle;

use crate::answers::Refusal;
use crate::decision::{
    Admission, AnsweredBy, Decision, LeaseRefusal, Quota, QuotaDecision, Recorded, RetryAfter,
    Scope,
};
use crate::error::Error;
use crate::headers::Headers;
use crate::ids::new_request_id;
use crate::leases::{Lease, LeaseGuard};
use crate::limiter::Limiter;
use crate::mutex::lock;
use crate::naming::Bucket;
use crate::policy::LogEvery;
use crate::reservations::Reservation;

type Extract = dyn Fn(&Parts) -> Option<String> + Send + Sync;
type LimitsOf = dyn Fn(&str) -> KeyLimits + Send + Sync;
type WindowOf = dyn Fn(&Parts, Option<&str>) -> Option<WindowLimit> + Send + Sync;

/// The limits the layer asks, in the order it asks them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LimitName {
    /// The caller's address's bucket.
    Client,
    /// The API key's bucket.
    Key,
    /// The key's quota.
    Quota,
    /// The key's concurrency slots.
    Concurrency,
    /// The request's window chain ([`RateLimitLayer::window_limit`]).
    Window,
}

impl LimitName {
    pub const ALL: [LimitName; 5] = [
        LimitName::Client,
        LimitName::Key,
        LimitName::Quota,
        LimitName::Concurrency,
        LimitName::Window,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            LimitName::Client => "client",
            LimitName::Key => "key",
            LimitName::Quota => "quota",
            LimitName::Concurrency => "concurrency",
            LimitName::Window => "window",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// How a limit answered the layer since it was made (decisions the `Forward` policy
/// answered counted nothing and are left out): `refused` counts, for a limit in shadow,
/// the refusals it let through.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LimitCounts {
    pub allowed: u64,
    pub refused: u64,
    pub shadow: bool,
}

/// One limit's counts and, in shadow, the pace of its log lines.
#[derive(Default)]
struct LimitState {
    shadow: bool,
    /// How long a request may wait for this limit's turn (`WAIT`) instead of a 429.
    wait: Option<Duration>,
    allowed: AtomicU64,
    refused: AtomicU64,
    /// Refusals let through in shadow: one line a second.
    shadow_log: Mutex<LogEvery>,
}

/// A key's own limits (ADR 0011: keys have their own); None where it has none of that
/// kind.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KeyLimits {
    /// The key's bucket: `count` per `period` seconds.
    pub bucket: Option<(u64, f64)>,
    /// How many of the key's requests may run at once.
    pub max_concurrent: Option<u64>,
    pub quota: Option<Quota>,
}

/// A request's window chain, for a model API: the scopes it is counted in (e.g. its
/// organisation's, its key's, its model's: requests and tokens per window), and the
/// tokens held for it until it commits its actual count.
#[derive(Clone, Debug, PartialEq)]
pub struct WindowLimit {
    pub scopes: Vec<Scope>,
    /// The tokens to hold: the request's estimate (e.g. its prompt's tokens plus its
    /// `max_tokens`). A request is admitted only if they fit on every scope beside what
    /// is counted and held.
    pub estimate: u64,
    /// The window's seconds (None: QAG.ADMIT's 60).
    pub window: Option<u32>,
    /// How long the hold may count at most (None: until the end of the next window).
    pub hold: Option<Duration>,
}

impl WindowLimit {
    /// The tokens to hold: the estimate, at least 1 (a reservation holds some).
    fn tokens(&self) -> u64 {
        self.estimate.max(1)
    }

    /// The estimate is above a scope's tokens per window: no wait lets it in.
    fn never_fits(&self) -> bool {
        let tokens = self.tokens();
        self.scopes
            .iter()
            .any(|scope| scope.tpm > 0 && scope.tpm < tokens)
    }
}

struct Config {
    client_bucket: Option<(u64, f64)>,
    client_address: Box<Extract>,
    api_key: Box<Extract>,
    key_limits: Box<LimitsOf>,
    window_limit: Option<Box<WindowOf>>,
    lease_ttl: Duration,
    draft_headers: bool,
    /// Requests answered 503 because a limit could not be asked: one line a second.
    unavailable_log: Mutex<LogEvery>,
    /// By [`LimitName::index`].
    limits: [LimitState; 5],
}

/// The layer: configure it once, `.layer(...)` it onto a router or service.
#[derive(Clone)]
pub struct RateLimitLayer<C> {
    limiter: Limiter<C>,
    config: Arc<Config>,
}

impl<C> std::fmt::Debug for RateLimitLayer<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("limiter", &self.limiter)
            .field("client_bucket", &self.config.client_bucket)
            .field("lease_ttl", &self.config.lease_ttl)
            .finish_non_exhaustive()
    }
}

impl<C> RateLimitLayer<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// A layer that limits nothing yet: add a client bucket, an API key and its limits.
    /// The caller's address is read from a `std::net::SocketAddr` request extension
    /// (see [`client_address`](Self::client_address) for axum's `ConnectInfo`).
    pub fn new(limiter: Limiter<C>) -> Self {
        RateLimitLayer {
            limiter,
            config: Arc::new(Config {
                client_bucket: None,
                client_address: Box::new(|parts| {
                    let peer = parts.extensions.get::<std::net::SocketAddr>()?;
                    Some(peer.ip().to_string())
                }),
                api_key: Box::new(|_| None),
                key_limits: Box::new(|_| KeyLimits::default()),
                window_limit: None,
                lease_ttl: Duration::from_secs(30),
                draft_headers: true,
                unavailable_log: Mutex::default(),
                limits: Default::default(),
            }),
        }
    }

    fn with(mut self, change: impl FnOnce(&mut Config)) -> Self {
        if let Some(config) = Arc::get_mut(&mut self.config) {
            change(config);
        }
        self
    }

    /// Every address's bucket: `count` requests per `period` seconds.
    pub fn client_bucket(self, count: u64, period: f64) -> Self {
        self.with(|config| config.client_bucket = Some((count, period)))
    }

    /// Where the caller's address comes from (e.g. axum's
    /// `parts.extensions.get::<ConnectInfo<SocketAddr>>()`).
    pub fn client_address(
        self,
        address: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.with(|config| config.client_address = Box::new(address))
    }

    /// Takes the address from a header set by a proxy the gateway trusts (its first
    /// entry, as `x-forwarded-for` lists them), else from the peer address.
    pub fn trusted_proxy_header(self, name: &'static str) -> Self {
        self.with(|config| {
            let peer = std::mem::replace(&mut config.client_address, Box::new(|_| None));
            config.client_address = Box::new(move |parts| {
                let forwarded = parts.headers.get(name).and_then(|v| v.to_str().ok());
                match forwarded.and_then(|v| v.split(',').next()) {
                    Some(first) if !first.trim().is_empty() => Some(first.trim().to_owned()),
                    _ => peer(parts),
                }
            });
        })
    }

    /// The request's API key (`<workspace>~<name>`), e.g. from a header or the query; a
    /// request without one is limited by its address alone.
    pub fn api_key(self, key: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static) -> Self {
        self.with(|config| config.api_key = Box::new(key))
    }

    /// The same limits for every key.
    pub fn key_limits(self, limits: KeyLimits) -> Self {
        self.with(|config| config.key_limits = Box::new(move |_| limits.clone()))
    }

    /// Each key's own limits, e.g. from the gateway's cache of its key table.
    pub fn key_limits_from(
        self,
        limits: impl Fn(&str) -> KeyLimits + Send + Sync + 'static,
    ) -> Self {
        self.with(|config| config.key_limits = Box::new(limits))
    }

    /// A window chain for each request that has one (`None`: the request has none),
    /// from its parts and its API key: asked last, after its slot, so that a request
    /// another limit refuses never charges a request to the chain. The estimate's tokens
    /// are held until the handler commits the actual count through the [`TokenHold`] in
    /// [`Admitted::window`] (or, uncommitted, until the body's end, what it charged is
    /// committed). A refusal answers 429 `rate_limited` with `exceeded` `requests` or
    /// `tokens`, giving back what the earlier limits took (tokens, slot). Every answer
    /// of a request that asked carries the chain's OpenAI-style fields
    /// ([`Headers::window`]). An estimate that depends on the body: read it in a layer
    /// before this one and put it in an extension that `window` reads from `Parts`.
    pub fn window_limit(
        self,
        window: impl Fn(&Parts, Option<&str>) -> Option<WindowLimit> + Send + Sync + 'static,
    ) -> Self {
        self.with(|config| config.window_limit = Some(Box::new(window)))
    }

    /// How long a slot is held before it runs out unless renewed (default 30 s; the
    /// guard renews it every third of that while the response streams).
    pub fn lease_ttl(self, ttl: Duration) -> Self {
        self.with(|config| config.lease_ttl = ttl)
    }

    /// Leaves out the draft's `ratelimit-policy` and `ratelimit` fields.
    pub fn without_draft_headers(self) -> Self {
        self.with(|config| config.draft_headers = false)
    }

    /// Puts a limit in shadow, to try it on live traffic before it refuses anyone: it is
    /// asked and counted as usual and its headers are sent, but a request it refuses is
    /// let through, logged (`log::warn!`, target `qag_client`, a line a second at most
    /// with how many it left out) and counted in [`limit_counts`](Self::limit_counts).
    pub fn shadow(self, limit: LimitName) -> Self {
        self.with(|config| config.limits[limit.index()].shadow = true)
    }

    /// Lets a request wait up to `wait` for `limit`'s turn instead of a 429 (a bucket's
    /// tokens, a concurrency slot: [`Limiter::with_wait`]), in arrival order across every
    /// gateway instance; the 429 comes only when the wait cannot fit, with the same body
    /// and headers as without it, and a request that waited says how long in its
    /// `server-timing` field (`qag-wait;dur=<ms>`). A request's two buckets are taken
    /// together, waiting up to the longer of their waits. The quota never waits (a
    /// period's calls do not come back), nor does a window chain (QAG.ADMIT has no
    /// `WAIT`): a wait given them is not used. The layer's limiter must be made with
    /// `Limiter::connect` or `Limiter::connect_cluster` (waits need connections of their
    /// own): else, and for a wait above 60 s, requests answer at once, and each such
    /// request logs why (a line a second at most).
    pub fn wait(self, limit: LimitName, wait: Duration) -> Self {
        self.with(|config| config.limits[limit.index()].wait = Some(wait))
    }

    /// How `limit` answered since the layer was made: for metrics, and to watch a limit
    /// in shadow before enforcing it.
    pub fn limit_counts(&self, limit: LimitName) -> LimitCounts {
        let state = &self.config.limits[limit.index()];
        LimitCounts {
            allowed: state.allowed.load(Ordering::Relaxed),
            refused: state.refused.load(Ordering::Relaxed),
            shadow: state.shadow,
        }
    }
}

impl<S, C> tower_layer::Layer<S> for RateLimitLayer<C>
where
    C: Clone,
{
    type Service = RateLimit<S, C>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit {
            inner,
            limiter: self.limiter.clone(),
            config: self.config.clone(),
        }
    }
}

/// The service the layer wraps around the application.
#[derive(Clone)]
pub struct RateLimit<S, C> {
    inner: S,
    limiter: Limiter<C>,
    config: Arc<Config>,
}

impl<S, C> std::fmt::Debug for RateLimit<S, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimit")
            .field("limiter", &self.limiter)
            .finish_non_exhaustive()
    }
}

/// What the layer decided, for the handler (a request extension).
#[derive(Clone, Debug)]
pub struct Admitted {
    pub request_id: String,
    pub api_key: Option<String>,
    pub client: Option<Decision>,
    pub key: Option<Decision>,
    /// The quota check before the call (the call is added after the handler answers).
    pub quota: Option<QuotaDecision>,
    /// Rows to add to the key's quota.
    pub rows: ReportRows,
    /// The tokens the request holds on its window chain, if it asked one and was
    /// admitted (a refusal a window in shadow let through holds none).
    pub window: Option<TokenHold>,
}

/// The tokens a request holds on its window chain ([`RateLimitLayer::window_limit`]),
/// for its handler: [`charge`](Self::charge) pays part of the count as the response
/// streams, [`commit`](Self::commit) charges the whole count and releases the hold.
/// Left uncommitted, what was charged is committed when the response body ends (or is
/// dropped), so the hold does not outlive the response. A clone is the same hold: one
/// the handler keeps beyond the response (say in a task of its own) keeps it, after a
/// request that ended early (cancelled, an error), until the last clone is dropped.
#[derive(Clone)]
pub struct TokenHold {
    admission: Admission,
    reserved: u64,
    reservation: Arc<dyn Settles>,
}

impl std::fmt::Debug for TokenHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenHold")
            .field("admission", &self.admission)
            .field("reserved", &self.reserved)
            .finish_non_exhaustive()
    }
}

impl TokenHold {
    /// QAG.ADMIT's answer: the chain's requests and tokens left (the hold counted).
    pub fn admission(&self) -> Admission {
        self.admission
    }

    /// The tokens held.
    pub fn reserved(&self) -> u64 {
        self.reserved
    }

    /// Pays `tokens` of the count now ([`Reservation::charge`]).
    pub async fn charge(&self, tokens: u64) -> Result<Recorded, Error> {
        self.reservation.clone().charge(tokens).await
    }

    /// Charges `actual`, the request's whole count (what was charged included), and
    /// releases the hold ([`Reservation::commit`]). Once: a hold committed already
    /// answers `Error::InvalidArgument`.
    pub async fn commit(&self, actual: u64) -> Result<Recorded, Error> {
        match self.reservation.clone().commit(Some(actual)).await {
            Some(answer) => answer,
            None => Err(Error::InvalidArgument(
                "the window's hold is committed already".into(),
            )),
        }
    }

    /// At the response's end: commits what was charged, if nothing was committed.
    async fn end(&self) {
        if let Some(Err(error)) = self.reservation.clone().commit(None).await {
            // The reservation goes on in the background (Reservation::commit).
            log::warn!(target: "qag_client", "committing a window's hold failed: {error}");
        }
    }
}

/// A reservation of any connection type, so that `TokenHold` has none.
trait Settles: Send + Sync {
    fn charge(self: Arc<Self>, tokens: u64) -> BoxFuture<Result<Recorded, Error>>;
    /// Commits `actual` (None: what was charged), unless committed already (None).
    fn commit(self: Arc<Self>, actual: Option<u64>) -> BoxFuture<Option<Result<Recorded, Error>>>;
}

/// A reservation until its commit (None after it).
struct Held<C>(tokio::sync::Mutex<Option<Reservation<C>>>)
where
    C: ConnectionLike + Clone + Send + Sync + 'static;

impl<C> Settles for Held<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    fn charge(self: Arc<Self>, tokens: u64) -> BoxFuture<Result<Recorded, Error>> {
        Box::pin(async move {
            match self.0.lock().await.as_mut() {
                Some(reservation) => reservation.charge(tokens).await,
                None => Err(Error::InvalidArgument(
                    "the window's hold is committed already".into(),
                )),
            }
        })
    }

    fn commit(self: Arc<Self>, actual: Option<u64>) -> BoxFuture<Option<Result<Recorded, Error>>> {
        Box::pin(async move {
            let reservation = self.0.lock().await.take()?;
            let actual = actual.unwrap_or_else(|| reservation.charged());
            Some(reservation.commit(actual).await)
        })
    }
}

/// Rows a handler reports for the key's quota: added with the call when the handler
/// has answered, and what is reported while a response streams when it ends.
#[derive(Clone, Debug, Default)]
pub struct ReportRows(Arc<AtomicU64>);

impl ReportRows {
    pub fn add(&self, rows: u64) {
        self.0.fetch_add(rows, Ordering::Relaxed);
    }

    fn take(&self) -> u64 {
        self.0.swap(0, Ordering::Relaxed)
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, C, B, R> tower_service::Service<Request<B>> for RateLimit<S, C>
where
    S: tower_service::Service<Request<B>, Response = Response<R>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send,
    B: Send + 'static,
    R: Body<Data = Bytes> + Unpin + Send + 'static,
    R::Error: Send,
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    type Response = Response<LimitedBody<R>>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        // The clone that was polled ready serves this call (tower's rule).
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let (limiter, config) = (self.limiter.clone(), self.config.clone());
        Box::pin(async move {
            let (mut parts, body) = request.into_parts();
            let mut request = Limited::new(&limiter, &config, &parts);
            let admitted = match request.admit().await {
                Ok(admitted) => admitted,
                Err(refusal) => return Ok(request.refuse(refusal)),
            };
            let rows = admitted.rows.clone();
            parts.extensions.insert(admitted);
            let response = inner.call(Request::from_parts(parts, body)).await?;
            Ok(request.answered(response, rows).await)
        })
    }
}

/// One request on its way through the limits.
struct Limited<'a, C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// The layer's limiter, for what runs after the request (rows reported late).
    base: &'a Limiter<C>,
    /// The limiter for this request: its calls share one deadline.
    limiter: Limiter<C>,
    config: &'a Config,
    /// Made for this request, never the caller's text (a caller choosing ids would get
    /// replays, uncharged, and could share a slot): its slot's lease id.
    id: String,
    request_id: String,
    quota_key: Option<String>,
    api_key: Option<String>,
    limits: KeyLimits,
    client_bucket: Option<Bucket>,
    key_bucket: Option<Bucket>,
    client: Option<Decision>,
    key: Option<Decision>,
    quota: Option<QuotaDecision>,
    /// The key's slots and the live leases when the request asked for one.
    slots: Option<(u64, u64)>,
    /// The slot refused (and enforced).
    lease_refused: Option<LeaseRefusal>,
    /// The clock (Unix seconds) a quota's refusal was decided by, for its fields: their
    /// `t` is then its `retry-after`.
    refused_at: Option<i64>,
    /// How long the request waited for its slot (`WAIT`).
    slot_waited: Duration,
    guard: Option<LeaseGuard<C>>,
    /// The request's window chain, if it has one.
    window_limit: Option<WindowLimit>,
    /// The chain's answer, once asked.
    chain: Option<Admission>,
    /// The tokens held on the chain, for the handler and the body's end.
    hold: Option<TokenHold>,
    /// A HEAD request: its body is never sent, so its end is the handler's answer.
    head: bool,
}

impl<'a, C> Limited<'a, C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    fn new(limiter: &'a Limiter<C>, config: &'a Config, parts: &Parts) -> Self {
        let id = new_request_id();
        // One deadline for every call the request makes (buckets, quota, slot); the
        // limiter's own ids (none on an admission, one kept seconds on a quota add).
        let view = limiter.for_request();
        let request_id = parts
            .headers
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .filter(|id| !id.is_empty() && id.len() <= 128)
            .map_or_else(|| id.clone(), str::to_owned);
        let api_key = (config.api_key)(parts);
        let limits = api_key
            .as_deref()
            .map_or_else(KeyLimits::default, |key| (config.key_limits)(key));
        let address = (config.client_address)(parts).unwrap_or_else(|| "unknown".into());
        let client_bucket = config
            .client_bucket
            .map(|(count, period)| Bucket::named("client", count, period, &address));
        let key_bucket = match (&api_key, limits.bucket) {
            (Some(key), Some((count, period))) => Some(Bucket::named("key", count, period, key)),
            _ => None,
        };
        let quota_key = match (&api_key, &limits.quota) {
            (Some(key), Some(_)) => Some(format!("qag:quota:{key}")),
            _ => None,
        };
        let window_limit = config
            .window_limit
            .as_ref()
            .and_then(|window| window(parts, api_key.as_deref()));
        Limited {
            head: parts.method == http::Method::HEAD,
            base: limiter,
            limiter: view,
            config,
            id,
            request_id,
            quota_key,
            api_key,
            limits,
            client_bucket,
            key_bucket,
            client: None,
            key: None,
            quota: None,
            slots: None,
            lease_refused: None,
            refused_at: None,
            slot_waited: Duration::ZERO,
            guard: None,
            window_limit,
            chain: None,
            hold: None,
        }
    }

    /// Asks every limit in order; a refusal gives back what the earlier ones took. A
    /// limit in shadow that refuses lets the request go on.
    async fn admit(&mut self) -> Result<Admitted, Refusal> {
        let quota = match (&self.quota_key, &self.limits.quota) {
            (Some(key), Some(quota)) => Some((key.clone(), quota.clone())),
            _ => None,
        };
        let (client_bucket, key_bucket) = (self.client_bucket.as_ref(), self.key_bucket.as_ref());
        let buckets = [LimitName::Client, LimitName::Key];
        let quota_check = match &quota {
            Some((quota_key, quota)) => {
                let taken = self
                    .ask(&buckets, |limiter| async move {
                        limiter
                            .take_with_quota(client_bucket, key_bucket, 1, quota_key, quota)
                            .await
                    })
                    .await;
                match taken {
                    Ok(taken) => {
                        (self.client, self.key) = (taken.client, taken.key);
                        Some(taken.quota)
                    }
                    Err(error) => return Err(self.failed(&error).await),
                }
            }
            None => {
                let taken = self
                    .ask(&buckets, |limiter| async move {
                        match (client_bucket, key_bucket) {
                            (Some(client), Some(key)) => limiter
                                .take_pair(client, key, 1)
                                .await
                                .map(|pair| (Some(pair.client), pair.key)),
                            (Some(client), None) => {
                                limiter.take(client, 1).await.map(|d| (Some(d), None))
                            }
                            (None, Some(key)) => {
                                limiter.take(key, 1).await.map(|d| (None, Some(d)))
                            }
                            (None, None) => Ok((None, None)),
                        }
                    })
                    .await;
                match taken {
                    Ok(taken) => (self.client, self.key) = taken,
                    Err(error) => return Err(self.failed(&error).await),
                }
                None
            }
        };
        // Read whatever the buckets say: a refusal shows what is left of the quota.
        if let Some(Ok(check)) = &quota_check {
            self.quota = Some(*check);
        }
        self.count(
            LimitName::Client,
            self.client.map(|d| (d.allowed, d.answered_by)),
        );
        if let Some(client) = self.client.filter(|client| !client.allowed) {
            if !self.shadowed(LimitName::Client) {
                return Err(Refusal::Client {
                    retry_after: client.retry_after,
                });
            }
            // Let through: the key's bucket, which QAG.TAKE2 leaves alone behind a
            // refusing client bucket, is taken on its own.
            if let (Some(key), None) = (key_bucket, self.key) {
                match self.limiter.take(key, 1).await {
                    Ok(key) => self.key = Some(key),
                    Err(error) => return Err(self.failed(&error).await),
                }
            }
        }
        self.count(LimitName::Key, self.key.map(|d| (d.allowed, d.answered_by)));
        if let Some(key) = self.key.filter(|key| !key.allowed) {
            if !self.shadowed(LimitName::Key) {
                self.give_back().await;
                return Err(Refusal::Key {
                    retry_after: key.retry_after,
                });
            }
        }
        if let Some(checked) = quota_check {
            let check = match checked {
                Ok(check) => check,
                Err(error) => return Err(self.failed(&error).await),
            };
            self.count(LimitName::Quota, Some((check.allowed, check.answered_by)));
            if !check.allowed && !self.shadowed(LimitName::Quota) {
                self.give_back().await;
                let exceeded = match check.calls_remaining {
                    Some(0) => "calls",
                    _ => "rows",
                };
                let now = unix_seconds();
                self.refused_at = Some(now);
                let retry_after = u64::try_from(check.resets_at - now).unwrap_or(0);
                return Err(Refusal::Quota {
                    exceeded,
                    resets_at: check.resets_at,
                    retry_after,
                });
            }
        }
        if let (Some(api_key), Some(max)) = (&self.api_key, self.limits.max_concurrent) {
            let slots = format!("qag:running:{api_key}");
            let (ttl, id) = (self.config.lease_ttl, &self.id);
            let slots = &slots;
            let lease = match self
                .ask(&[LimitName::Concurrency], |limiter| async move {
                    limiter.lease(slots, max, ttl, id).await
                })
                .await
            {
                Ok(lease) => lease,
                Err(error) => return Err(self.failed(&error).await),
            };
            match lease {
                Lease::Held(guard) => {
                    let by = guard.answered_by();
                    self.slot_waited = guard.waited();
                    self.count(LimitName::Concurrency, Some((true, by)));
                    if by != AnsweredBy::Forwarded {
                        self.slots = Some((max, guard.live()));
                    }
                    self.guard = Some(guard);
                }
                Lease::Refused(refusal) => {
                    let by = refusal.answered_by;
                    self.slot_waited = refusal.waited;
                    self.count(LimitName::Concurrency, Some((false, by)));
                    self.slots = Some((max, refusal.live));
                    if !self.shadowed(LimitName::Concurrency) {
                        self.lease_refused = Some(refusal);
                        self.give_back().await;
                        return Err(Refusal::Concurrency);
                    }
                }
            }
        }
        match &self.window_limit {
            Some(limit) if limit.never_fits() => {
                self.count(LimitName::Window, Some((false, AnsweredBy::Module)));
                if !self.shadowed(LimitName::Window) {
                    self.give_back().await;
                    return Err(Refusal::Window {
                        exceeded: "tokens",
                        retry_after: RetryAfter::Never,
                    });
                }
            }
            Some(limit) => self.ask_window(limit.clone()).await?,
            None => {}
        }
        Ok(Admitted {
            request_id: self.request_id.clone(),
            api_key: self.api_key.clone(),
            client: self.client,
            key: self.key,
            quota: self.quota,
            rows: ReportRows::default(),
            window: self.hold.clone(),
        })
    }

    /// Holds the request's estimate on its window chain.
    async fn ask_window(&mut self, limit: WindowLimit) -> Result<(), Refusal> {
        let reserved = self
            .limiter
            .reserve(&limit.scopes, limit.tokens(), limit.window, limit.hold)
            .await;
        let reservation = match reserved {
            Ok(reservation) => reservation,
            Err(error) => return Err(self.failed(&error).await),
        };
        let admission = reservation.admission();
        self.chain = Some(admission);
        self.count(
            LimitName::Window,
            Some((admission.admitted, admission.answered_by)),
        );
        if !admission.admitted && !self.shadowed(LimitName::Window) {
            self.give_back().await;
            // None left, or the estimate does not fit beside what is counted.
            let exceeded = match admission.requests_remaining {
                Some(0) => "requests",
                _ => "tokens",
            };
            return Err(Refusal::Window {
                exceeded,
                retry_after: admission.retry_after,
            });
        }
        // A refusal the window in shadow let through holds nothing: no hold.
        self.hold = admission.admitted.then(|| TokenHold {
            admission,
            reserved: reservation.reserved(),
            reservation: Arc::new(Held(tokio::sync::Mutex::new(Some(reservation)))),
        });
        Ok(())
    }

    /// Asks `ask` of the limiter waiting up to the longest of `limits`' waits (or of the
    /// limiter as it is, when none waits, or it cannot: logged). A waiting call that
    /// finds no connection for waits free (`Error::Busy`: `max_waiting` calls wait
    /// already) is asked again at once without waiting, as the server answers a call
    /// beyond its `MAX-WAITERS`: a 200 or a 429 then, not a 503.
    async fn ask<T, F, Fut>(&self, limits: &[LimitName], ask: F) -> Result<T, Error>
    where
        F: Fn(Limiter<C>) -> Fut,
        Fut: Future<Output = Result<T, Error>>,
    {
        let Some(waiting) = self.waiting(limits) else {
            return ask(self.limiter.clone()).await;
        };
        match ask(waiting).await {
            Err(Error::Busy(_)) => ask(self.limiter.clone()).await,
            answer => answer,
        }
    }

    /// The request's limiter waiting up to the longest of `limits`' waits, if any
    /// waits and it can (else logged).
    fn waiting(&self, limits: &[LimitName]) -> Option<Limiter<C>> {
        let wait = limits
            .iter()
            .filter_map(|limit| self.config.limits[limit.index()].wait)
            .max()?;
        match self.limiter.with_wait(wait) {
            Ok(waiting) => Some(waiting),
            Err(error) => {
                let left_out =
                    lock(&self.config.unavailable_log).due(Instant::now(), Duration::from_secs(1));
                if left_out.is_some() {
                    log::warn!(target: "qag_client", "request {} does not wait: {error}", self.request_id);
                }
                None
            }
        }
    }

    /// Counts a limit's decision (allowed or not, and how it was answered): a forwarded
    /// one counted nothing.
    fn count(&self, limit: LimitName, decision: Option<(bool, AnsweredBy)>) {
        let state = &self.config.limits[limit.index()];
        match decision {
            Some((_, AnsweredBy::Forwarded)) | None => {}
            Some((true, _)) => drop(state.allowed.fetch_add(1, Ordering::Relaxed)),
            Some((false, _)) => drop(state.refused.fetch_add(1, Ordering::Relaxed)),
        }
    }

    /// A limit refused: true if it is in shadow (the refusal logged, a line a second at
    /// most, and let through).
    fn shadowed(&self, limit: LimitName) -> bool {
        let state = &self.config.limits[limit.index()];
        if !state.shadow {
            return false;
        }
        let left_out = lock(&state.shadow_log).due(Instant::now(), Duration::from_secs(1));
        if let Some(left_out) = left_out {
            let since = match left_out {
                0 => String::new(),
                n => format!(" ({n} more since the last such line)"),
            };
            log::warn!(
                target: "qag_client",
                "shadow: the {} limit refused request {} and let it through{since}",
                limit.as_str(),
                self.request_id
            );
        }
        true
    }

    /// A limit could not be asked: 503 under the `Raise` policy (the other policies
    /// answer an outage instead of failing), or for an error no policy answers (a
    /// missing module, NOPERM); what the buckets took is given back.
    async fn failed(&mut self, error: &Error) -> Refusal {
        self.give_back().await;
        let left_out =
            lock(&self.config.unavailable_log).due(Instant::now(), Duration::from_secs(1));
        if let Some(left_out) = left_out {
            let since = match left_out {
                0 => String::new(),
                n => format!(" ({n} more since the last such line)"),
            };
            log::warn!(
                target: "qag_client",
                "request {} answered 503, a limit could not be asked: {error}{since}",
                self.request_id
            );
        }
        Refusal::Unavailable {
            retry_after: self.limiter.options().back_off.as_secs().max(1),
        }
    }

    /// Gives back what the earlier limits took for a request a later limit refused: its
    /// slot, and the tokens the buckets took from Redis (the headers then show what the
    /// buckets hold after it). Only Redis's: a forwarded take took nothing, a local one
    /// is not worth a token that a refund to Redis, or to a local bucket cleared since,
    /// would mint; and nothing during a back-off.
    async fn give_back(&mut self) {
        if let Some(guard) = self.guard.take() {
            // A failed release goes on in the background (LeaseGuard::release).
            drop(guard.release().await);
        }
        for (bucket, decision) in [
            (&self.client_bucket, &mut self.client),
            (&self.key_bucket, &mut self.key),
        ] {
            let (Some(bucket), Some(taken)) = (bucket, decision.as_mut()) else {
                continue;
            };
            let from_redis = matches!(taken.answered_by, AnsweredBy::Module | AnsweredBy::Script);
            if !taken.allowed || !from_redis || self.limiter.backing_off() {
                continue;
            }
            match self.limiter.refund(bucket, 1).await {
                Ok(refunded) => taken.remaining = refunded.remaining,
                Err(error) => {
                    log::warn!(target: "qag_client", "refund to {} failed: {error}", bucket.key())
                }
            }
        }
    }

    fn headers<'b>(&'b self, quota: Option<&'b QuotaDecision>) -> Headers<'b> {
        let mut headers = Headers::new();
        if let Some(client) = &self.client {
            headers = headers.client(client);
        }
        if let Some(key) = &self.key {
            headers = headers.key(key);
        }
        if let Some(quota) = quota {
            headers = headers.quota(quota);
        }
        if let Some((max, live)) = self.slots {
            headers = headers.slots(max, live);
        }
        if let (Some(limit), Some(admission)) = (&self.window_limit, &self.chain) {
            headers = headers.window(&limit.scopes, admission, limit.window);
        }
        if let Some(refusal) = &self.lease_refused {
            headers = headers.lease_refused(refusal);
        }
        if let Some(now) = self.refused_at {
            headers = headers.now(now);
        }
        headers = headers.slot_waited(self.slot_waited);
        if !self.config.draft_headers {
            headers = headers.without_draft();
        }
        headers
    }

    fn refuse<R: Body>(&self, refusal: Refusal) -> Response<LimitedBody<R>> {
        let mut headers = self.headers(self.quota.as_ref()).header_map();
        headers.remove("retry-after");
        if let Some(seconds) = refusal.retry_after() {
            headers.insert("retry-after", HeaderValue::from(seconds));
        }
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        let mut response = Response::new(LimitedBody::refusal(Bytes::from(
            refusal.body(&self.request_id),
        )));
        *response.status_mut() =
            StatusCode::from_u16(refusal.status()).unwrap_or(StatusCode::TOO_MANY_REQUESTS);
        *response.headers_mut() = headers;
        response
    }

    /// The handler answered: the call (and the rows reported so far) is added to the
    /// quota, the headers are set, and the slot is held until the body's end.
    async fn answered<R: Body<Data = Bytes> + Unpin>(
        mut self,
        response: Response<R>,
        rows: ReportRows,
    ) -> Response<LimitedBody<R>> {
        let mut quota_after = self.quota;
        let quota = match (self.quota_key.take(), &self.limits.quota) {
            (Some(key), Some(quota)) => Some((key, quota.clone())),
            _ => None,
        };
        if let Some((key, quota)) = &quota {
            match self.limiter.quota_add(key, quota, 1, rows.take()).await {
                Ok(usage) => quota_after = self.quota.map(|check| check.after_add(&usage)),
                Err(error) => {
                    log::warn!(target: "qag_client", "quota add for {key} failed: {error}")
                }
            }
        }
        let mut fields = self.headers(quota_after.as_ref()).header_map();
        // Admitted: a refusal a limit in shadow let through asks no wait.
        fields.remove("retry-after");
        let (mut parts, body) = response.into_parts();
        parts.headers.extend(fields);
        let at_end = Box::new(AtEnd {
            guard: self.guard.take(),
            hold: self.hold.take(),
            // Its own id: a second add with the request's would be a replay.
            rows: quota.map(|(key, quota)| (self.base.clone(), key, quota, rows)),
        });
        let mut body = LimitedBody::answer(body);
        if !(body.whole_now() || self.head) {
            body.end_with(at_end);
            return Response::from_parts(parts, body);
        }
        // A body whole already (most answers: a frame or none), or never sent: it ends
        // here, before its headers go out. Held back until then, its last frame would
        // go out in a write of its own, which Nagle's algorithm and the client's
        // delayed ACK hold about 40 ms on a kept-alive connection.
        if let Some(end) = at_end.end() {
            drop(end.await);
        }
        Response::from_parts(parts, body)
    }
}

/// What ends with a response's body: the slot is released, and rows reported while it
/// streamed are added to the quota. Awaited before the body's end goes out (as the ASGI
/// middleware does), so a client that sends its next request once it has read a
/// response finds the slot free; in the background if the body is dropped first (a
/// client gone mid-stream).
struct AtEnd<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    guard: Option<LeaseGuard<C>>,
    hold: Option<TokenHold>,
    rows: Option<(Limiter<C>, String, Quota, ReportRows)>,
}

/// An `AtEnd` of any connection type, so that `LimitedBody` has none.
trait EndsWithBody: Send + Sync {
    /// The end as a task of its own (none outside a runtime: dropped, it ends in the
    /// background), so that a body dropped while awaiting it cannot cut it short.
    fn end(self: Box<Self>) -> Option<JoinHandle<()>>;
}

/// The end being awaited, and the body's last frame (none: its end) held until it is
/// done.
struct Ending {
    end: JoinHandle<()>,
    last: Option<Frame<Bytes>>,
}

impl<C> EndsWithBody for AtEnd<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    fn end(mut self: Box<Self>) -> Option<JoinHandle<()>> {
        if self.guard.is_none() && self.hold.is_none() && self.rows.is_none() {
            return None; // nothing to end: no task
        }
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        let guard = self.guard.take();
        let hold = self.hold.take();
        let rows = self.rows.take();
        Some(runtime.spawn(async move {
            if let Some(hold) = hold {
                hold.end().await;
            }
            if let Some(guard) = guard {
                // A failed release goes on in the background (LeaseGuard::release).
                drop(guard.release().await);
            }
            if let Some((limiter, key, quota, rows)) = rows {
                add_late_rows(&limiter, &key, &quota, &rows).await;
            }
        }))
    }
}

impl<C> Drop for AtEnd<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    fn drop(&mut self) {
        drop(self.guard.take());
        let (hold, rows) = (self.hold.take(), self.rows.take());
        if hold.is_none() && rows.is_none() {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if let Some(hold) = hold {
                    hold.end().await;
                }
                if let Some((limiter, key, quota, rows)) = rows {
                    add_late_rows(&limiter, &key, &quota, &rows).await;
                }
            });
        }
    }
}

/// Adds to the quota the rows reported since the handler answered, if any.
async fn add_late_rows<C>(limiter: &Limiter<C>, key: &str, quota: &Quota, rows: &ReportRows)
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    let late = rows.take();
    if late == 0 {
        return;
    }
    if let Err(error) = limiter.quota_add(key, quota, 0, late).await {
        log::warn!(target: "qag_client", "adding {late} rows to {key} failed: {error}");
    }
}

/// A response body through the layer: the handler's, holding what must end with it
/// (see `AtEnd`), or a refusal's JSON.
pub struct LimitedBody<B: Body>(BodyState<B>);

enum BodyState<B: Body> {
    Answer {
        body: B,
        /// The frame the layer polled from the body before the server did.
        first: Option<Result<Frame<Bytes>, B::Error>>,
        /// The body returned its end.
        ended: bool,
        at_end: Option<Box<dyn EndsWithBody>>,
        ending: Option<Ending>,
    },
    Refusal(Option<Bytes>),
}

impl<B: Body> LimitedBody<B> {
    fn answer(body: B) -> Self {
        LimitedBody(BodyState::Answer {
            body,
            first: None,
            ended: false,
            at_end: None,
            ending: None,
        })
    }

    fn refusal(bytes: Bytes) -> Self {
        LimitedBody(BodyState::Refusal(Some(bytes)))
    }

    /// What ends with the body, before its end goes out.
    fn end_with(&mut self, end: Box<dyn EndsWithBody>) {
        if let BodyState::Answer { at_end, .. } = &mut self.0 {
            *at_end = Some(end);
        }
    }
}

impl<B: Body<Data = Bytes> + Unpin> LimitedBody<B> {
    /// Whether the body is whole now: polled once if need be (without a waker: the
    /// server polls again with its own), what it gave kept for the server.
    fn whole_now(&mut self) -> bool {
        let BodyState::Answer {
            body, first, ended, ..
        } = &mut self.0
        else {
            return true;
        };
        if body.is_end_stream() {
            return true;
        }
        match Pin::new(&mut *body).poll_frame(&mut Context::from_waker(Waker::noop())) {
            Poll::Pending => false,
            Poll::Ready(None) => {
                *ended = true;
                true
            }
            Poll::Ready(Some(frame)) => {
                let whole = frame
                    .as_ref()
                    .is_ok_and(|frame| frame.is_trailers() || body.is_end_stream());
                *first = Some(frame);
                whole
            }
        }
    }
}

// No field is pinned: the handler's body is `Unpin`, the rest is moved freely.
impl<B: Body> Unpin for LimitedBody<B> {}

impl<B: Body> std::fmt::Debug for LimitedBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            BodyState::Answer { at_end, .. } => f
                .debug_struct("Answer")
                .field("holding", &at_end.is_some())
                .finish_non_exhaustive(),
            BodyState::Refusal(bytes) => f.debug_tuple("Refusal").field(bytes).finish(),
        }
    }
}

impl<B: Body<Data = Bytes> + Unpin> Body for LimitedBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let (body, first, ended, at_end, ending) = match &mut self.get_mut().0 {
            BodyState::Answer {
                body,
                first,
                ended,
                at_end,
                ending,
            } => (body, first, ended, at_end, ending),
            BodyState::Refusal(bytes) => {
                return Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b))))
            }
        };
        loop {
            if let Some(Ending { end, last }) = ending {
                if Pin::new(end).poll(cx).is_pending() {
                    return Poll::Pending;
                }
                let last = last.take();
                *ending = None;
                return Poll::Ready(last.map(Ok));
            }
            let frame = match first.take() {
                Some(frame) => Some(frame),
                None if *ended => None,
                None => match Pin::new(&mut *body).poll_frame(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(frame) => frame,
                },
            };
            *ended |= frame.is_none();
            // The last frame (or the end) waits for the slot's release: the server stops
            // polling once the body says it ended, or after trailers.
            let last = match frame {
                None => None,
                Some(Ok(frame)) if frame.is_trailers() || body.is_end_stream() => Some(frame),
                other => return Poll::Ready(other),
            };
            match at_end.take().and_then(|at_end| at_end.end()) {
                Some(end) => *ending = Some(Ending { end, last }),
                None => return Poll::Ready(last.map(Ok)),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.0 {
            // Not while the end is still to be awaited (an empty body included).
            BodyState::Answer {
                body,
                first,
                ended,
                at_end,
                ending,
            } => {
                at_end.is_none()
                    && ending.is_none()
                    && first.is_none()
                    && (*ended || body.is_end_stream())
            }
            BodyState::Refusal(bytes) => bytes.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.0 {
            BodyState::Answer {
                body, first, ended, ..
            } => {
                let mut hint = if *ended {
                    SizeHint::with_exact(0)
                } else {
                    body.size_hint()
                };
                // The bytes taken out of the body before the server polled it.
                if let Some(Ok(frame)) = first {
                    let taken = frame.data_ref().map_or(0, |data| data.len() as u64);
                    let upper = hint.upper().map(|upper| upper.saturating_add(taken));
                    let lower = hint.lower().saturating_add(taken);
                    hint = SizeHint::new();
                    hint.set_lower(lower);
                    if let Some(upper) = upper {
                        hint.set_upper(upper);
                    }
                }
                hint
            }
            BodyState::Refusal(bytes) => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
        }
    }
}

fn unix_seconds() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_secs() as i64)
}
