//! A `tower::Layer` that limits every request as ADR 0032 and ADR 0011 say, for axum,
//! hyper 1.x (through hyper-util's tower adapter) and any tower stack (feature `tower`):
//!
//! 1. the client's bucket, keyed by the caller's address: a refusal answers 429
//!    `rate_limited` and the key's bucket is not touched;
//! 2. the key's bucket: 429 `rate_limited` ("for this API key"), the client's token given
//!    back;
//! 3. the key's quota: 429 `quota_exceeded`, naming what ran out and when it resets;
//! 4. the key's concurrency slot: 429 `too_many_concurrent` with `retry-after: 1`.
//!
//! A later refusal gives back what earlier steps took (QAG.REFUND), so a request
//! refused by its quota or its slot costs no tokens. An admitted request holds its slot
//! until the response body's last byte (a stream keeps it while it streams) and frees
//! it when the body is dropped early (a client that went away); its call is added to
//! the quota when the handler has answered, with the rows it reported through
//! [`ReportRows`]. Every response to a limited caller carries the headers of what was
//! counted; the handler finds the decisions in the [`Admitted`] extension.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use redis::aio::ConnectionLike;

use crate::answers::Refusal;
use crate::decision::{AnsweredBy, Decision, PairDecision, Quota, QuotaDecision};
use crate::error::Error;
use crate::headers::Headers;
use crate::ids::new_request_id;
use crate::leases::{Lease, LeaseGuard};
use crate::limiter::Limiter;
use crate::mutex::lock;
use crate::naming::Bucket;
use crate::policy::LogEvery;

type Extract = dyn Fn(&Parts) -> Option<String> + Send + Sync;
type LimitsOf = dyn Fn(&str) -> KeyLimits + Send + Sync;

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

struct Config {
    client_bucket: Option<(u64, f64)>,
    client_address: Box<Extract>,
    api_key: Box<Extract>,
    key_limits: Box<LimitsOf>,
    lease_ttl: Duration,
    draft_headers: bool,
    /// Requests answered 503 because a limit could not be asked: one line a second.
    unavailable_log: Mutex<LogEvery>,
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
                lease_ttl: Duration::from_secs(30),
                draft_headers: true,
                unavailable_log: Mutex::default(),
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

    /// How long a slot is held before it runs out unless renewed (default 30 s; the
    /// guard renews it every third of that while the response streams).
    pub fn lease_ttl(self, ttl: Duration) -> Self {
        self.with(|config| config.lease_ttl = ttl)
    }

    /// Leaves out the draft's `ratelimit-policy` and `ratelimit` fields.
    pub fn without_draft_headers(self) -> Self {
        self.with(|config| config.draft_headers = false)
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
    guard: Option<LeaseGuard<C>>,
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
        Limited {
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
            guard: None,
        }
    }

    /// Asks every limit in order; a refusal gives back what the earlier ones took.
    async fn admit(&mut self) -> Result<Admitted, Refusal> {
        let pair = match (&self.client_bucket, &self.key_bucket) {
            (Some(client), Some(key)) => Some(self.limiter.take_pair(client, key, 1).await),
            (Some(client), None) => Some(
                self.limiter
                    .take(client, 1)
                    .await
                    .map(|client| PairDecision { client, key: None }),
            ),
            (None, Some(key)) => Some(self.limiter.take(key, 1).await.map(|key| PairDecision {
                client: key,
                key: None,
            })),
            (None, None) => None,
        };
        if let Some(pair) = pair {
            let pair = match pair {
                Ok(pair) => pair,
                Err(error) => return Err(self.failed(&error).await),
            };
            if self.client_bucket.is_some() {
                self.client = Some(pair.client);
                self.key = pair.key;
            } else {
                self.key = Some(pair.client);
            }
            if let Some(client) = self.client.filter(|client| !client.allowed) {
                return Err(Refusal::Client {
                    retry_after: client.retry_after,
                });
            }
            if let Some(key) = self.key.filter(|key| !key.allowed) {
                self.give_back().await;
                return Err(Refusal::Key {
                    retry_after: key.retry_after,
                });
            }
        }
        if let (Some(quota_key), Some(quota)) = (&self.quota_key, &self.limits.quota) {
            let check = match self.limiter.quota_check(quota_key, quota).await {
                Ok(check) => check,
                Err(error) => return Err(self.failed(&error).await),
            };
            self.quota = Some(check);
            if !check.allowed {
                self.give_back().await;
                let exceeded = match check.calls_remaining {
                    Some(0) => "calls",
                    _ => "rows",
                };
                let retry_after = u64::try_from(check.resets_at - unix_seconds()).unwrap_or(0);
                return Err(Refusal::Quota {
                    exceeded,
                    resets_at: check.resets_at,
                    retry_after,
                });
            }
        }
        if let (Some(api_key), Some(max)) = (&self.api_key, self.limits.max_concurrent) {
            let slots = format!("qag:running:{api_key}");
            let lease = match self
                .limiter
                .lease(&slots, max, self.config.lease_ttl, &self.id)
                .await
            {
                Ok(lease) => lease,
                Err(error) => return Err(self.failed(&error).await),
            };
            match lease {
                Lease::Held(guard) => self.guard = Some(guard),
                Lease::Refused(_) => {
                    self.give_back().await;
                    return Err(Refusal::Concurrency);
                }
            }
        }
        Ok(Admitted {
            request_id: self.request_id.clone(),
            api_key: self.api_key.clone(),
            client: self.client,
            key: self.key,
            quota: self.quota,
            rows: ReportRows::default(),
        })
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

    /// Gives back the tokens the buckets took from Redis for a request a later limit
    /// refused, and shows what the buckets hold after it. Only Redis's: a forwarded take
    /// took nothing, a local one is not worth a token that a refund to Redis, or to a
    /// local bucket cleared since, would mint; and nothing during a back-off.
    async fn give_back(&mut self) {
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
        if !self.config.draft_headers {
            headers = headers.without_draft();
        }
        headers
    }

    fn refuse<R>(&self, refusal: Refusal) -> Response<LimitedBody<R>> {
        let mut headers = self.headers(self.quota.as_ref()).header_map();
        headers.remove("retry-after");
        if let Some(seconds) = refusal.retry_after() {
            headers.insert("retry-after", HeaderValue::from(seconds));
        }
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        let mut response = Response::new(LimitedBody::Refusal(Some(Bytes::from(
            refusal.body(&self.request_id),
        ))));
        *response.status_mut() =
            StatusCode::from_u16(refusal.status()).unwrap_or(StatusCode::TOO_MANY_REQUESTS);
        *response.headers_mut() = headers;
        response
    }

    /// The handler answered: the call (and the rows reported so far) is added to the
    /// quota, the headers are set, and the slot is held until the body's end.
    async fn answered<R>(
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
        let fields = self.headers(quota_after.as_ref()).header_map();
        let (mut parts, body) = response.into_parts();
        parts.headers.extend(fields);
        let at_end = AtEnd {
            guard: self.guard.take(),
            // Its own id: a second add with the request's would be a replay.
            rows: quota.map(|(key, quota)| (self.base.clone(), key, quota, rows)),
        };
        Response::from_parts(parts, LimitedBody::Answer(body, Some(Box::new(at_end))))
    }
}

/// What ends with a response's body: the slot is released (the guard's drop), and rows
/// reported while it streamed are added to the quota.
struct AtEnd<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    guard: Option<LeaseGuard<C>>,
    rows: Option<(Limiter<C>, String, Quota, ReportRows)>,
}

impl<C> Drop for AtEnd<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    fn drop(&mut self) {
        drop(self.guard.take());
        let Some((limiter, key, quota, rows)) = self.rows.take() else {
            return;
        };
        let late = rows.take();
        if late == 0 {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if let Err(error) = limiter.quota_add(&key, &quota, 0, late).await {
                    log::warn!(target: "qag_client", "adding {late} rows to {key} failed: {error}");
                }
            });
        }
    }
}

/// A response body through the layer: the handler's, holding what must last until its
/// end, or a refusal's JSON.
pub enum LimitedBody<B> {
    Answer(B, Option<Box<dyn Send + Sync>>),
    Refusal(Option<Bytes>),
}

impl<B> std::fmt::Debug for LimitedBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LimitedBody::Answer(_, at_end) => f
                .debug_struct("Answer")
                .field("holding", &at_end.is_some())
                .finish_non_exhaustive(),
            LimitedBody::Refusal(bytes) => f.debug_tuple("Refusal").field(bytes).finish(),
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
        match self.get_mut() {
            LimitedBody::Answer(body, at_end) => {
                let frame = Pin::new(body).poll_frame(cx);
                if let Poll::Ready(None) = frame {
                    // The last byte went out: the slot is free now, not when the
                    // connection gets around to dropping the body.
                    drop(at_end.take());
                }
                frame
            }
            LimitedBody::Refusal(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            LimitedBody::Answer(body, _) => body.is_end_stream(),
            LimitedBody::Refusal(bytes) => bytes.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            LimitedBody::Answer(body, _) => body.size_hint(),
            LimitedBody::Refusal(bytes) => {
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
