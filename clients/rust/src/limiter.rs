//! The thin layer that talks to Redis: the connection, which backend answers (the
//! module's command, or the family's script on the same keys), the per-call deadline,
//! and running every call under the outage policy. The commands of each family are in
//! their own files (buckets, leases, quotas, windows).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use qag_core::args::ArgError;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::{cmd, Cmd, FromRedisValue, Value};

use crate::cluster::{common_slot, parse_slots, Kind, Topology};
use crate::decision::AnsweredBy;
use crate::error::{classify, demoted, probe_failed, redacted, Error, Failure};
use crate::ids::{check_id, new_request_id};
use crate::local::LocalState;
use crate::mutex::lock;
use crate::nodes::ClusterNodes;
use crate::policy::{Counts, OnUnavailable, Outage, ProberStep, Route};
use crate::waiting::WaitConnections;

/// The repository's token-bucket script, compiled in: the module's contract, one text.
pub const TOKEN_BUCKET_LUA: &str = include_str!("../../../lua/token_bucket.lua");
/// The repository's refund script, QAG.REFUND's twin on the same keys.
pub const TOKEN_REFUND_LUA: &str = include_str!("../../../lua/token_refund.lua");
/// The token-bucket script for a call with a request id: request ids' part and the
/// buckets' part of it, then the script: the module's rules, the reply remembered.
pub const TOKEN_BUCKET_IDS_LUA: &str = concat!(
    include_str!("../../../lua/request_ids.lua"),
    include_str!("../../../lua/bucket_ids.lua"),
    include_str!("../../../lua/token_bucket.lua")
);
/// The refund script for a call with a request id, as [`TOKEN_BUCKET_IDS_LUA`].
pub const TOKEN_REFUND_IDS_LUA: &str = concat!(
    include_str!("../../../lua/request_ids.lua"),
    include_str!("../../../lua/bucket_ids.lua"),
    include_str!("../../../lua/token_refund.lua")
);
/// The lease family's script: QAG.LEASE, RENEW, RELEASE and LEASES on the same keys.
pub const LEASE_LUA: &str = include_str!("../../../lua/lease.lua");
/// The quota family's script: request ids' part, then QAG.QUOTA, QUOTA.ADD and
/// QUOTA.SEED on the same keys (the calendar period given by the client).
pub const QUOTA_LUA: &str = concat!(
    include_str!("../../../lua/request_ids.lua"),
    include_str!("../../../lua/quota.lua")
);
/// The window family's script: request ids' part, then QAG.ADMIT and QAG.RECORD
/// (reservations included) on the same keys.
pub const WINDOW_LUA: &str = concat!(
    include_str!("../../../lua/request_ids.lua"),
    include_str!("../../../lua/window.lua")
);

/// Where calls go: the module's commands, or each family's script (lua/), which keeps
/// the same keys and answers the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Backend {
    /// The module where the server has it, else the scripts: the module's command is
    /// sent, and a server answering "unknown command" is remembered without it (per
    /// node on a cluster) for `recheck_missing_module`.
    #[default]
    Auto,
    /// The module only: [`Error::ModuleRequired`] where it is missing.
    Module,
    /// The scripts only, even where the module is loaded.
    Script,
}

/// How a [`Limiter`] behaves; `Options::default()` is what a gateway runs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Options {
    pub backend: Backend,
    /// Every call's deadline: connecting, detection and fallback included.
    pub deadline: Duration,
    /// What a call does when Redis fails, and during the back-off after it.
    pub on_unavailable: OnUnavailable,
    /// The longest wait between probes of Redis after a failure: the first probe comes
    /// 0.1 s after it, each that fails doubles the wait, up to this (zero: no back-off,
    /// every call tries Redis; a day at most). Calls keep to the policy until a probe
    /// (the back-off's prober's, in the background, whether calls come or not) has found
    /// Redis answering.
    pub back_off: Duration,
    /// This process's share of every limit under [`OnUnavailable::Local`]: 1/N for N
    /// gateway processes keeps a fleet near its limits during an outage. Above 1 counts
    /// as 1; zero, negative or NaN as 1 too.
    pub local_share: f64,
    /// How long a server found without the module is believed: after that, `Auto`
    /// asks again (the module may have been loaded in a rolling upgrade).
    pub recheck_missing_module: Duration,
    /// On a cluster, a `take_pair` whose buckets are in two slots.
    pub cross_slot: CrossSlot,
    /// How many calls may wait at once ([`Limiter::with_wait`]), each on a connection of
    /// its own; a call beyond them waits for one within its deadline, then is
    /// [`Error::Busy`].
    pub max_waiting: usize,
}

/// What `take_pair` does on a cluster with buckets in two slots (QAG.TAKE2 would answer
/// CROSSSLOT, the script would run them apart): the same whether the module or the
/// script answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CrossSlot {
    /// [`Error::CrossSlot`], nothing sent: give both buckets a common hash tag.
    #[default]
    Error,
    /// Two calls: the client bucket, then, if it allowed, the key bucket; a key bucket
    /// that refuses gets the client bucket's tokens given back (QAG.REFUND or the
    /// refund script).
    TwoCalls,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            backend: Backend::Auto,
            deadline: Duration::from_millis(500),
            on_unavailable: OnUnavailable::Raise,
            back_off: Duration::from_secs(5),
            local_share: 1.0,
            recheck_missing_module: Duration::from_secs(10),
            cross_slot: CrossSlot::Error,
            max_waiting: 100,
        }
    }
}

/// What `Auto` knows of the server: missing since when, if it answered "unknown
/// command".
#[derive(Clone, Copy, Debug, Default)]
enum Presence {
    #[default]
    Unknown,
    Missing {
        since: Instant,
    },
}

/// The path a call takes to Redis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Path {
    Module,
    Script,
}

/// What the limiter knows of one server: the module's presence, the back-off and the
/// local counts (on a cluster, one per primary; else one).
#[derive(Default)]
pub(crate) struct Node {
    /// `host:port` on a cluster, "" on a single server (as [`Shared`] keeps it).
    name: String,
    presence: Mutex<Presence>,
    outage: Mutex<Outage>,
    pub(crate) local: Mutex<LocalState>,
    counts: Mutex<Counts>,
    /// Something was counted locally since Redis last answered (without a back-off,
    /// the next answer drops it).
    counted_locally: AtomicBool,
    /// Whether the server's module takes KEEP after an id (None: not known yet, or the
    /// connection failed since).
    keeps: Mutex<Option<bool>>,
}

pub(crate) struct Shared {
    /// By `host:port` on a cluster; "" before the slot table is known, and on a single
    /// server.
    nodes: Mutex<HashMap<String, Arc<Node>>>,
    /// Shared with the connection when it routes by it ([`ClusterNodes`]).
    topology: Arc<Mutex<Topology>>,
    /// The limiter's deadline (a view's for one call may be shorter).
    pub(crate) deadline: Duration,
    pub(crate) script: redis::Script,
    pub(crate) script_with_ids: redis::Script,
    pub(crate) refund_script: redis::Script,
    pub(crate) refund_script_with_ids: redis::Script,
    pub(crate) lease_script: redis::Script,
    pub(crate) quota_script: redis::Script,
    pub(crate) window_script: redis::Script,
}

/// A future of the connection's, boxed (a ping of one node).
pub(crate) type Pinged = Pin<Box<dyn Future<Output = redis::RedisResult<()>> + Send>>;

/// How the limiter reaches Redis: its connection, shared by every clone, swapped for a
/// fresh one after READONLY where the limiter made it (a primary demoted by a failover;
/// a fresh connection reaches whatever the address names now), and how one node is
/// asked whether it answers (the probe after a back-off).
pub(crate) struct Link<C> {
    con: Mutex<(C, u64)>,
    /// A new connection to the same address (None: only the caller could make one).
    fresh: Option<Box<dyn Fn() -> Option<C> + Send + Sync>>,
    ping: fn(C, String) -> Pinged,
    /// Connections for waiting calls (None: the caller gave the connection; the limiter
    /// cannot make others).
    waits: Option<WaitConnections>,
}

impl<C: ConnectionLike + Clone + Send + 'static> Link<C> {
    fn new(con: C) -> Link<C> {
        Link {
            con: Mutex::new((con, 0)),
            fresh: None,
            ping: ping_any::<C>,
            waits: None,
        }
    }

    /// The connection now, and which it is (for [`Link::replace`]).
    pub(crate) fn con(&self) -> (C, u64) {
        lock(&self.con).clone()
    }

    /// The connection `which` answered READONLY: a fresh one replaces it (once, however
    /// many calls met it), where the limiter can make one.
    fn replace(&self, which: u64) {
        let Some(fresh) = &self.fresh else {
            return;
        };
        let mut con = lock(&self.con);
        if con.1 == which {
            if let Some(new) = fresh() {
                *con = (new, which + 1);
            }
        }
    }
}

/// PING on the connection (a single server: whichever node it reaches).
fn ping_any<C: ConnectionLike + Send + 'static>(mut con: C, _node: String) -> Pinged {
    Box::pin(async move { cmd("PING").query_async::<Value>(&mut con).await.map(drop) })
}

/// A rate limiter over one connection (a `ConnectionManager`, a `MultiplexedConnection`
/// or an async cluster connection). Cheap to clone: clones share what they know of the
/// servers, the back-offs and the local counts. On a cluster, each primary has its own
/// module presence, back-off and local counts (the slot table read with `CLUSTER
/// SLOTS`), so one shard's failure changes nothing for keys on the others.
pub struct Limiter<C> {
    pub(crate) link: Arc<Link<C>>,
    pub(crate) options: Options,
    pub(crate) shared: Arc<Shared>,
    /// The node this view of the limiter calls (see [`Limiter::for_keys`]).
    pub(crate) node: Arc<Node>,
    /// The caller's request id for every call (see [`Limiter::with_id`]); else each
    /// call makes its own.
    pub(crate) id: Option<Arc<str>>,
    /// What is left of one request's time with Redis, shared by every call of this view
    /// (see [`Limiter::for_request`]); None: each call has the deadline.
    pub(crate) budget: Option<Arc<Mutex<Duration>>>,
    /// How long this view's takes and leases wait for their turn (see
    /// [`Limiter::with_wait`]).
    pub(crate) wait: Option<Duration>,
}

impl<C: Clone> Clone for Limiter<C> {
    fn clone(&self) -> Self {
        Limiter {
            link: self.link.clone(),
            options: self.options,
            shared: self.shared.clone(),
            node: self.node.clone(),
            id: self.id.clone(),
            budget: self.budget.clone(),
            wait: self.wait,
        }
    }
}

/// The least a spend call's own id is remembered (its KEEP, seconds).
const OWN_ID_KEEP: u64 = 10;

/// An older module's answer to a word it does not know in a spend call's options.
fn refuses_keep(reason: &str) -> bool {
    [
        "syntax error",
        "wrong number of arguments",
        "numscopes does not match",
    ]
    .iter()
    .any(|words| reason.contains(words))
}

/// Turns of the runtime a call is given after its deadline for an answer already on its
/// way (read from the socket, handed to the call): a busy process's delay, not the
/// server's.
const LATE_TURNS: usize = 3;

/// `call`'s output if it comes within `window`, or within a few more turns of the
/// runtime after it.
async fn answered_within<F: std::future::Future>(window: Duration, call: F) -> Option<F::Output> {
    tokio::pin!(call);
    if let Ok(output) = tokio::time::timeout(window, &mut call).await {
        return Some(output);
    }
    for _ in 0..LATE_TURNS {
        tokio::task::yield_now().await;
        let polled = std::future::poll_fn(|context| {
            std::task::Poll::Ready(match call.as_mut().poll(context) {
                std::task::Poll::Ready(output) => Some(output),
                std::task::Poll::Pending => None,
            })
        });
        if let Some(output) = polled.await {
            return Some(output);
        }
    }
    None
}

impl<C> std::fmt::Debug for Limiter<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limiter")
            .field("options", &self.options)
            .field("counts", &self.shared.counts())
            .finish_non_exhaustive()
    }
}

impl Shared {
    fn node(&self, name: &str) -> Arc<Node> {
        lock(&self.nodes)
            .entry(name.to_owned())
            .or_insert_with(|| {
                Arc::new(Node {
                    name: name.to_owned(),
                    ..Node::default()
                })
            })
            .clone()
    }

    fn all(&self) -> Vec<Arc<Node>> {
        lock(&self.nodes).values().cloned().collect()
    }

    fn counts(&self) -> Counts {
        let mut total = Counts::default();
        for node in self.all() {
            total.add(&lock(&node.counts));
        }
        total
    }
}

/// What a call answers, and how it was made (for [`Limiter::counts`]).
pub(crate) trait Answer {
    fn answered_by(&self) -> Option<AnsweredBy>;
}

impl Answer for bool {
    fn answered_by(&self) -> Option<AnsweredBy> {
        None
    }
}

impl Answer for u64 {
    fn answered_by(&self) -> Option<AnsweredBy> {
        None
    }
}

/// What answers a call that does not reach Redis, under the `Forward` and `Local`
/// policies; the family's closure answers None where it has nothing to answer (then the
/// outage's error is returned).
pub(crate) enum Instead<'a> {
    Forward,
    Local {
        state: &'a mut LocalState,
        /// Unix microseconds.
        now_micros: i64,
        share: f64,
    },
}

pub(crate) fn unix_micros() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_micros() as i64)
}

/// A back-off's prober, given back if its task is dropped before the back-off ended
/// (its runtime shut down): the next call starts another.
struct ProberTurn {
    node: Weak<Node>,
    running: bool,
}

impl Drop for ProberTurn {
    fn drop(&mut self) {
        if let (true, Some(node)) = (self.running, self.node.upgrade()) {
            lock(&node.outage).prober_dropped();
        }
    }
}

/// The loop of [`Limiter::start_prober`]: it ends when a probe is answered, when the
/// limiter is dropped, and on a cluster when the slot table no longer names its node.
async fn prober<C: ConnectionLike + Clone + Send + 'static>(
    mut turn: ProberTurn,
    link: Weak<Link<C>>,
    topology: Weak<Mutex<Topology>>,
    options: Options,
) {
    let within = options
        .back_off
        .min(Duration::from_secs(2))
        .max(options.deadline);
    loop {
        let (Some(node), Some(link)) = (turn.node.upgrade(), link.upgrade()) else {
            return; // the limiter is gone
        };
        if let Some(topology) = topology.upgrade() {
            let topology = lock(&topology);
            // "" is the node of calls no node of the table serves: never forgotten.
            let named = node.name.is_empty() || topology.names(&node.name);
            if topology.kind == Kind::Cluster && !named {
                // A node the cluster's table no longer names (failed over, removed):
                // never probed again, its back-off forgotten with it (else the limiter
                // would say it backs off for as long as the node stays down).
                turn.running = false;
                lock(&node.outage).forget();
                lock(&node.local).clear();
                return;
            }
        }
        let step = lock(&node.outage).prober_step(Instant::now());
        match step {
            ProberStep::End => {
                turn.running = false;
                return;
            }
            ProberStep::Wait(wait) => {
                drop((node, link));
                tokio::time::sleep(wait.min(Duration::from_secs(1))).await;
                continue;
            }
            ProberStep::Probe => {}
        }
        let ping = (link.ping)(link.con().0, node.name.clone());
        let answer = match tokio::time::timeout(within, ping).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(error)) => probe_failed(&error),
            Err(_) => Err(Error::Timeout),
        };
        match answer {
            Ok(()) => {
                turn.running = false;
                if lock(&node.outage).answered() {
                    lock(&node.local).clear();
                }
                return;
            }
            Err(error) => {
                *lock(&node.presence) = Presence::Unknown;
                if let Some(topology) = topology.upgrade() {
                    lock(&topology).node_failed();
                }
                lock(&node.outage).failed(true, Instant::now(), options.back_off, &error);
            }
        }
    }
}

impl Limiter<ConnectionManager> {
    /// A limiter on its own `ConnectionManager` for `url` that connects on first use, so
    /// a gateway starts while Redis is down. Connecting and reconnecting are bounded by
    /// the deadline, like every call. Call it inside a tokio runtime.
    pub async fn connect(url: &str, options: Options) -> Result<Limiter<ConnectionManager>, Error> {
        let client = redis::Client::open(url).map_err(|error| {
            Error::InvalidArgument(format!("redis URL {:?}: {error}", redacted(url)))
        })?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(options.deadline))
            .set_response_timeout(Some(options.deadline))
            // One reconnect attempt per failure: the limiter's back-off paces the rest.
            .set_number_of_retries(1);
        let con = ConnectionManager::new_lazy_with_config(client.clone(), config.clone())
            .map_err(|error| failure_error(classify(&error)))?;
        let mut link = Link::new(con);
        let info = client.get_connection_info().clone();
        link.waits = Some(WaitConnections::new(
            Box::new(move |_| Ok(info.clone())),
            options.max_waiting.max(1),
            options.deadline,
            None,
        ));
        // After READONLY: a new connection to the URL, which a failover (DNS, a proxy, a
        // managed service's endpoint) may have moved to the new primary.
        link.fresh = Some(Box::new(move || {
            ConnectionManager::new_lazy_with_config(client.clone(), config.clone()).ok()
        }));
        Ok(Limiter::with_link(link, options, Arc::default()))
    }
}

impl Limiter<ClusterNodes> {
    /// A limiter on a Redis Cluster that `seeds` (`redis://…` URLs of some of its nodes;
    /// the first one's user and password are used for all) belong to, routing each call
    /// itself: to the primary owning its keys' slot in the slot table the limiter reads,
    /// on a connection of its own per node, following MOVED, ASK and TRYAGAIN. Connects
    /// on first use (a gateway starts while the cluster is down), within the deadline.
    pub fn connect_cluster(
        seeds: &[&str],
        options: Options,
    ) -> Result<Limiter<ClusterNodes>, Error> {
        let nodes = ClusterNodes::new(seeds.to_vec(), options.deadline).map_err(|error| {
            let seeds: Vec<String> = seeds.iter().map(|seed| redacted(seed)).collect();
            Error::InvalidArgument(format!("cluster seeds {seeds:?}: {error}"))
        })?;
        let topology = nodes.topology();
        let address = nodes.address();
        let mut link = Link::new(nodes);
        link.ping = |nodes, node| Box::pin(async move { nodes.ping(&node).await });
        link.waits = Some(WaitConnections::new(
            address,
            options.max_waiting.max(1),
            options.deadline,
            Some(topology.clone()),
        ));
        Ok(Limiter::with_link(link, options, topology))
    }
}

impl<C> Limiter<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    pub fn new(con: C) -> Limiter<C> {
        Limiter::with_options(con, Options::default())
    }

    pub fn with_options(con: C, options: Options) -> Limiter<C> {
        Limiter::with_link(Link::new(con), options, Arc::default())
    }

    fn with_link(
        link: Link<C>,
        mut options: Options,
        topology: Arc<Mutex<Topology>>,
    ) -> Limiter<C> {
        let share = options.local_share;
        options.local_share = if share > 0.0 { share.min(1.0) } else { 1.0 };
        let shared = Arc::new(Shared {
            nodes: Mutex::new(HashMap::new()),
            topology,
            deadline: options.deadline,
            script: redis::Script::new(TOKEN_BUCKET_LUA),
            script_with_ids: redis::Script::new(TOKEN_BUCKET_IDS_LUA),
            refund_script: redis::Script::new(TOKEN_REFUND_LUA),
            refund_script_with_ids: redis::Script::new(TOKEN_REFUND_IDS_LUA),
            lease_script: redis::Script::new(LEASE_LUA),
            quota_script: redis::Script::new(QUOTA_LUA),
            window_script: redis::Script::new(WINDOW_LUA),
        });
        Limiter {
            link: Arc::new(link),
            options,
            node: shared.node(""),
            shared,
            id: None,
            budget: None,
            wait: None,
        }
    }

    /// This limiter with the caller's own request id (e.g. the gateway's id of the
    /// request, so that its retries of one request count once): every call that counts
    /// (`take`, `take_pair`, `refund`, `quota_add`, `admit`, `reserve`, `record`) sends
    /// `ID id`. The module keeps ids per key and per command, so one id serves every call
    /// one request makes; a second call of one command on one key with that id is a
    /// replay: it answers the first call's reply and counts nothing. Never take it from
    /// the incoming request unchecked: a caller who picks ids gets the first answer
    /// again, uncharged, by reusing one. 1 to 128 bytes, else
    /// [`Error::InvalidArgument`] (nothing is sent).
    pub fn with_id(&self, id: &str) -> Result<Limiter<C>, Error> {
        check_id(id)?;
        let mut limiter = self.clone();
        limiter.id = Some(id.into());
        Ok(limiter)
    }

    /// This limiter for one request: the calls it makes (and its clones make) share one
    /// deadline of time with Redis, each waiting at most what the others left of it, so a
    /// slow Redis costs the request one deadline, not one a call (the tower layer makes
    /// one a request). A call that finds nothing left is the outage the request has met
    /// (answered by the policy, as a call past its deadline is).
    pub fn for_request(&self) -> Limiter<C> {
        let mut limiter = self.clone();
        limiter.budget = Some(Arc::new(Mutex::new(self.options.deadline)));
        limiter
    }

    /// This limiter with calls that wait up to `wait` for their turn (`WAIT ms`, module
    /// 0.5.0): `take`, `take_pair`, `take_with_quota` and `lease` that would be refused
    /// now but whose tokens (or a slot) come within `wait` are held by the server and
    /// answered then, in arrival order across every gateway instance (their answers say
    /// how long they waited: [`Decision::waited`](crate::Decision)); one that cannot be
    /// served within `wait` is refused at once, as without it. Each such call's deadline
    /// is its wait plus the usual deadline, and it is sent on a connection of its own
    /// (the shared one would stall every call behind it), from a pool of
    /// [`Options::max_waiting`]; a wait cut short (its deadline, or the call's future
    /// dropped) closes its connection, and the server gives back what it was charged.
    /// Without the module (the script) calls answer at once, as without `wait`. At most
    /// 60 s; [`Error::InvalidArgument`] beyond, or for a limiter made with
    /// [`Limiter::new`] (on the caller's connection: it cannot make others).
    pub fn with_wait(&self, wait: Duration) -> Result<Limiter<C>, Error> {
        if self.link.waits.is_none() {
            return Err(Error::InvalidArgument(
                "waiting calls need connections of their own: make the limiter with \
                 Limiter::connect or Limiter::connect_cluster"
                    .into(),
            ));
        }
        let most = Duration::from_millis(qag_core::wait::MAX_WAIT_MS as u64);
        if wait > most {
            return Err(Error::InvalidArgument(format!(
                "wait must be at most {most:?}, not {wait:?}"
            )));
        }
        let mut limiter = self.clone();
        limiter.wait = Some(wait);
        Ok(limiter)
    }

    /// The caller's request id, if [`Limiter::with_id`] gave one.
    pub fn request_id(&self) -> Option<&str> {
        self.id.as_deref()
    }

    /// The id a call that records spend sends (a quota add, a record, a reservation):
    /// the caller's, else a new one, so that its replay counts once.
    pub(crate) fn call_id(&self) -> String {
        self.id
            .as_deref()
            .map_or_else(new_request_id, str::to_owned)
    }

    pub fn options(&self) -> Options {
        self.options
    }

    /// True while Redis is left alone after a failure (a back-off runs, until its
    /// prober's probe is answered; on a cluster, on some node): calls are answered by
    /// the policy.
    pub fn backing_off(&self) -> bool {
        self.shared
            .all()
            .iter()
            .any(|node| lock(&node.outage).backing_off())
    }

    /// True while calls are decided in this process (`Local`, backing off).
    pub fn counting_locally(&self) -> bool {
        self.options.on_unavailable == OnUnavailable::Local && self.backing_off()
    }

    /// How many calls were decided locally since the limiter was built.
    pub fn local_decisions(&self) -> u64 {
        self.shared.counts().local
    }

    /// How calls were answered since the limiter was built, and how many failed.
    pub fn counts(&self) -> Counts {
        self.shared.counts()
    }

    /// A failure nobody awaits (a background release or renewal): counted and logged.
    pub(crate) fn background_failure(&self, what: &str, error: &Error) {
        lock(&self.node.counts).errors += 1;
        log::warn!(target: "qag_client", "{what} failed: {error}");
    }

    /// This limiter as it calls the node owning the keys' slot (one slot, else
    /// [`Error::CrossSlot`] with nothing sent): its state is that node's. On a single
    /// server, and while the slot table is unknown, the one node. The first call reads
    /// the table (`CLUSTER SLOTS`, within the deadline; a server without cluster
    /// support answers that it has none); later readings run in the background when due.
    pub(crate) async fn for_keys(&self, keys: &[&str]) -> Result<Limiter<C>, Error> {
        self.for_keys_from(keys, Instant::now()).await
    }

    /// [`Limiter::for_keys`] for a call that began at `started`: the view's deadline is
    /// what is left of the call's (the first reading of the table included).
    pub(crate) async fn for_keys_from(
        &self,
        keys: &[&str],
        started: Instant,
    ) -> Result<Limiter<C>, Error> {
        self.first_table().await;
        let now = Instant::now();
        let troubled = self.troubled();
        let (owner, refresh) = {
            let mut topology = lock(&self.shared.topology);
            if topology.kind == Kind::Cluster && troubled {
                topology.node_failed();
            }
            let refresh = topology.start_refresh(now);
            let owner = match topology.kind {
                Kind::Cluster => topology.owner(common_slot(keys)?).map(str::to_owned),
                _ => None,
            };
            (owner, refresh)
        };
        if refresh {
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    let task = read_table(
                        self.link.con().0,
                        self.shared.clone(),
                        self.options.deadline,
                    );
                    drop(runtime.spawn(task));
                }
                Err(_) => lock(&self.shared.topology).refresh_failed(now),
            }
        }
        let mut limiter = self.clone();
        limiter.node = self.shared.node(owner.as_deref().unwrap_or(""));
        let left = self.options.deadline.saturating_sub(started.elapsed());
        limiter.options.deadline = left.max(Duration::from_millis(1));
        Ok(limiter)
    }

    /// The first reading of the slot table, once (the calls meanwhile go on).
    async fn first_table(&self) {
        let first = {
            let mut topology = lock(&self.shared.topology);
            topology.kind == Kind::Unknown && topology.start_first()
        };
        if first {
            read_table(
                self.link.con().0,
                self.shared.clone(),
                self.options.deadline,
            )
            .await;
        }
    }

    /// True on a cluster (as far as the slot table says).
    pub(crate) async fn on_cluster(&self) -> bool {
        self.first_table().await;
        lock(&self.shared.topology).kind == Kind::Cluster
    }

    /// Whether the slot table names a node that is backing off (its replica may have
    /// taken over: the table is read again).
    fn troubled(&self) -> bool {
        let nodes: Vec<(String, Arc<Node>)> = lock(&self.shared.nodes)
            .iter()
            .map(|(name, node)| (name.clone(), node.clone()))
            .collect();
        let topology = lock(&self.shared.topology);
        nodes
            .iter()
            .any(|(name, node)| topology.names(name) && lock(&node.outage).backing_off())
    }

    /// Runs one call under the outage policy: to Redis within the deadline unless a
    /// back-off runs; an outage starts a back-off (and its prober) and is answered by
    /// the policy: no request waits for a probe.
    pub(crate) async fn run<T: Answer>(
        &self,
        remote: impl std::future::Future<Output = Result<T, Error>>,
        instead: impl FnOnce(Instead<'_>) -> Option<T>,
    ) -> Result<T, Error> {
        let route = lock(&self.node.outage).route();
        let answer = match route {
            Route::Policy | Route::StartProber => {
                if route == Route::StartProber {
                    self.start_prober();
                }
                let cause = lock(&self.node.outage).backing_off_error();
                self.answer_instead(instead, cause)
            }
            Route::Redis => match self.within_deadline(remote).await {
                // A call its request's time cut short says nothing of Redis: the policy
                // answers it, and no back-off starts.
                (Err(Error::Timeout), true) => self.answer_instead(instead, Error::Timeout),
                (Err(error), _) if error.is_unavailable() => {
                    self.outage_met(&error);
                    self.answer_instead(instead, error)
                }
                (answer, _) => {
                    if self.options.back_off.is_zero()
                        && self.node.counted_locally.swap(false, Ordering::Relaxed)
                    {
                        lock(&self.node.local).clear();
                    }
                    answer
                }
            },
        };
        let mut counts = lock(&self.node.counts);
        match &answer {
            Ok(answer) => {
                if let Some(by) = answer.answered_by() {
                    counts.count(by);
                }
            }
            Err(_) => counts.errors += 1,
        }
        answer
    }

    /// A call met an outage: a back-off starts (the slot table is read again).
    fn outage_met(&self, error: &Error) {
        lock(&self.shared.topology).node_failed();
        let back_off = self.options.back_off;
        if lock(&self.node.outage).failed(false, Instant::now(), back_off, error) {
            self.start_prober();
        }
    }

    /// The back-off's prober, a task of its own: when each probe is due it asks this
    /// node whether it answers (PING), with up to the back-off (at most 2 s, at least
    /// the deadline) counted from its own start, whether calls come or not. The
    /// server's answer (any reply, an error reply too, but an outage's) ends the back-off
    /// and drops the local counts; anything else (no reply, a failure on this side) puts
    /// the next probe twice as far off. It holds the limiter weakly: a limiter dropped
    /// meanwhile ends it at its next wake, at most a second later.
    fn start_prober(&self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            lock(&self.node.outage).prober_dropped();
            return;
        };
        let turn = ProberTurn {
            node: Arc::downgrade(&self.node),
            running: true,
        };
        let link = Arc::downgrade(&self.link);
        let topology = Arc::downgrade(&self.shared.topology);
        let options = self.options;
        drop(runtime.spawn(prober(turn, link, topology, options)));
    }

    fn answer_instead<T>(
        &self,
        instead: impl FnOnce(Instead<'_>) -> Option<T>,
        cause: Error,
    ) -> Result<T, Error> {
        let answer = match self.options.on_unavailable {
            OnUnavailable::Raise => None,
            OnUnavailable::Forward => instead(Instead::Forward),
            OnUnavailable::Local => {
                self.node.counted_locally.store(true, Ordering::Relaxed);
                instead(Instead::Local {
                    state: &mut lock(&self.node.local),
                    now_micros: unix_micros(),
                    share: self.options.local_share,
                })
            }
        };
        answer.ok_or(cause)
    }

    /// Bounds a call by the deadline (or what is left of its request's), an answer
    /// already on its way at the deadline taken; a server that failed to answer is asked
    /// again whether it has the module (it may have been restarted without it, or with
    /// it). True beside the answer when the request's time left the call less than a
    /// deadline.
    async fn within_deadline<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, Error>>,
    ) -> (Result<T, Error>, bool) {
        let window = match &self.budget {
            Some(left) => self.options.deadline.min(*lock(left)),
            None => self.options.deadline,
        };
        // A call that may wait has its wait on top (the server holds it, on purpose).
        let wait = self.wait.unwrap_or_default();
        let started = Instant::now();
        let answer = if window.is_zero() {
            Err(Error::Timeout)
        } else {
            answered_within(window + wait, call)
                .await
                .unwrap_or(Err(Error::Timeout))
        };
        if let Some(left) = &self.budget {
            let mut left = lock(left);
            *left = left.saturating_sub(started.elapsed().saturating_sub(wait));
        }
        let cut = window < self.options.deadline;
        if answer.as_ref().is_err_and(Error::is_unavailable) && !cut {
            self.forget_presence();
        }
        (answer, cut)
    }

    /// A failed or new connection: the next call asks the server again what it has.
    fn forget_presence(&self) {
        *lock(&self.node.presence) = Presence::Unknown;
        *lock(&self.node.keeps) = None;
    }

    /// The KEEP seconds of a spend call's own id: the deadline and a second, at least
    /// OWN_ID_KEEP (its replays come within the call).
    pub(crate) fn own_keep(&self) -> u64 {
        let keep = self.options.deadline.as_secs_f64().ceil() as u64 + 1;
        keep.clamp(OWN_ID_KEEP, 86_400)
    }

    /// The module's reply to a spend call (a quota add, a record) whose words end with
    /// its id, or None where this node has no module (see [`Limiter::module_reply`]):
    /// with `own_id` (the limiter's, replayed only within the call), `KEEP seconds`
    /// after it, so the key remembers the id a few seconds, not ID-SECONDS. A module
    /// older than KEEP refuses the word, writing nothing: the call is sent again without,
    /// and this server is not asked with it again until the connection fails.
    pub(crate) async fn spend_call<T: FromRedisValue>(
        &self,
        words: &[String],
        own_id: bool,
    ) -> Result<Option<T>, Error> {
        let keeps = *lock(&self.node.keeps);
        if own_id && keeps != Some(false) {
            let mut kept = words.to_vec();
            kept.extend(["KEEP".into(), self.own_keep().to_string()]);
            match self.module_reply(&command(&kept), true).await {
                Err(Error::Server(reason)) if keeps.is_none() && refuses_keep(&reason) => {
                    *lock(&self.node.keeps) = Some(false);
                }
                answer => {
                    if matches!(answer, Ok(Some(_))) {
                        *lock(&self.node.keeps) = Some(true);
                    }
                    return answer;
                }
            }
        }
        self.module_reply(&command(words), true).await
    }

    /// A module command failed: a missing command means the module is gone from this
    /// server; `Auto` goes on with the script, `Module` reports it.
    pub(crate) fn module_failed(&self, failure: Failure) -> Result<(), Error> {
        match failure {
            Failure::UnknownCommand => {
                self.note_missing();
                if self.options.backend == Backend::Auto {
                    Ok(())
                } else {
                    Err(Error::ModuleRequired)
                }
            }
            Failure::Error(error) => Err(error),
        }
    }

    /// The module's reply to a family's command, or None where this node has no module
    /// and the family's script is to answer: `Script`, or `Auto` on a node that answered
    /// "unknown command" lately (this call's answer tells too); `Module` reports a
    /// missing module. `replayable`: a command that carries an `ID` or only reads, sent
    /// once more after a dropped connection (see [`Limiter::query_replayable`]).
    pub(crate) async fn module_reply<T: FromRedisValue>(
        &self,
        command: &Cmd,
        replayable: bool,
    ) -> Result<Option<T>, Error> {
        if self.path().await? == Path::Script {
            return Ok(None);
        }
        let answer = match replayable {
            true => self.query_replayable(command).await,
            false => self.query(command).await,
        };
        match answer {
            Ok(reply) => Ok(Some(reply)),
            Err(failure) => self.module_failed(failure).map(|()| None),
        }
    }

    /// A family's script on its keys, the module's twin (EVALSHA, and SCRIPT LOAD when
    /// the server answers NOSCRIPT); `replayable` as for [`Limiter::module_reply`].
    pub(crate) async fn script_reply<T: FromRedisValue>(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
        replayable: bool,
    ) -> Result<T, Error> {
        self.sent(
            |mut con| async move { invocation.invoke_async(&mut con).await },
            replayable,
        )
        .await
        .map_err(failure_error)
    }

    /// A family's call: the module's command where this node has the module, else its
    /// script, and which answered.
    pub(crate) async fn family_call<T: FromRedisValue>(
        &self,
        command: &Cmd,
        script: &redis::ScriptInvocation<'_>,
        replayable: bool,
    ) -> Result<(T, AnsweredBy), Error> {
        if let Some(reply) = self.module_reply(command, replayable).await? {
            return Ok((reply, AnsweredBy::Module));
        }
        let reply = self.script_reply(script, replayable).await?;
        Ok((reply, AnsweredBy::Script))
    }

    /// As [`Limiter::family_call`], for a call that may wait ([`Limiter::with_wait`]):
    /// the module's command with `WAIT ms` after it, on a connection of its own; the
    /// script answers at once.
    pub(crate) async fn family_call_waiting<T: FromRedisValue>(
        &self,
        command: &Cmd,
        script: &redis::ScriptInvocation<'_>,
        replayable: bool,
    ) -> Result<(T, AnsweredBy), Error> {
        if self.path().await? == Path::Module {
            let mut command = command.clone();
            self.wait_words(&mut command);
            let command = &command;
            let sent = self.sent_waiting(
                |mut con| async move { command.query_async(&mut con).await },
                replayable,
            );
            match sent.await {
                Ok(reply) => return Ok((reply, AnsweredBy::Module)),
                Err(failure) => self.module_failed(failure)?,
            }
        }
        let reply = self.script_reply(script, replayable).await?;
        Ok((reply, AnsweredBy::Script))
    }

    /// Which path a call takes now: the module unless this node answered
    /// "unknown command" within `recheck_missing_module` (the call's own reply tells,
    /// on the node that runs it: no separate question to any node).
    pub(crate) async fn path(&self) -> Result<Path, Error> {
        match self.options.backend {
            Backend::Module => return Ok(Path::Module),
            Backend::Script => return Ok(Path::Script),
            Backend::Auto => {}
        }
        let presence = *lock(&self.node.presence);
        match presence {
            Presence::Missing { since }
                if since.elapsed() < self.options.recheck_missing_module =>
            {
                Ok(Path::Script)
            }
            _ => Ok(Path::Module),
        }
    }

    fn note_missing(&self) {
        *lock(&self.node.presence) = Presence::Missing {
            since: Instant::now(),
        };
    }

    pub(crate) async fn query<T: FromRedisValue>(&self, command: &Cmd) -> Result<T, Failure> {
        self.sent(
            |mut con| async move { command.query_async(&mut con).await },
            false,
        )
        .await
    }

    /// Sends a command, and once more when the connection dropped before its reply
    /// (reset, EOF, broken pipe: whether it ran is unknown): one that carries an `ID`
    /// (the module answers the replay with the first call's reply if it ran, so it
    /// counts once either way), one that only reads (a restart drops the connection
    /// under every call: no outage), or an admission without an id (a take, a pair, an
    /// ADMIT: if the first ran, the replay charges again, erring stricter by one, never
    /// granting more). The caller's deadline bounds both. A timeout is never resent (no
    /// time is left), and no other write without an id comes here (a refund twice would
    /// give back twice).
    pub(crate) async fn query_replayable<T: FromRedisValue>(
        &self,
        command: &Cmd,
    ) -> Result<T, Failure> {
        self.replayed(|mut con| async move { command.query_async(&mut con).await })
            .await
    }

    /// `send` on the connection, and once more as [`Limiter::query_replayable`] says.
    pub(crate) async fn replayed<T, F, Fut>(&self, send: F) -> Result<T, Failure>
    where
        F: Fn(C) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        self.sent(send, true).await
    }

    /// `send` on the connection; sent once more after READONLY, whatever it is (a
    /// primary demoted by a failover ran nothing), on a fresh connection where the
    /// limiter made the first (a failover moves the address to the new primary, or the
    /// second READONLY is the outage), and, when `replayable`, after a dropped
    /// connection (see [`Limiter::query_replayable`]).
    pub(crate) async fn sent<T, F, Fut>(&self, send: F, replayable: bool) -> Result<T, Failure>
    where
        F: Fn(C) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        let (con, which) = self.link.con();
        match send(con).await {
            Err(error) if demoted(&error) => {
                log::debug!(target: "qag_client", "a demoted primary, once more: {error}");
                self.link.replace(which);
                self.forget_presence();
                send(self.link.con().0)
                    .await
                    .map_err(|error| classify(&error))
            }
            // A ConnectionManager reconnects after the failure: the replay waits for
            // the fresh connection, which may reach a server restarted with or without
            // the module (the next call asks again).
            Err(error) if replayable && error.is_connection_dropped() && !error.is_timeout() => {
                log::debug!(target: "qag_client", "replaying a call after: {error}");
                self.forget_presence();
                send(self.link.con().0)
                    .await
                    .map_err(|error| classify(&error))
            }
            answer => answer.map_err(|error| classify(&error)),
        }
    }
}

impl<C> Limiter<C>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// `words` with `WAIT ms` after them when this view waits.
    pub(crate) fn wait_words(&self, command: &mut Cmd) {
        if let Some(wait) = self.wait {
            command
                .arg("WAIT")
                .arg(wait.as_millis().min(u128::from(u64::MAX)) as u64);
        }
    }

    /// `send` on a connection of its own when this view waits (`with_wait`: a wait cut
    /// short closes its connection, and the server gives back: never sent again), else
    /// on the shared one as [`Limiter::sent`] sends it.
    pub(crate) async fn sent_waiting<T, F, Fut>(
        &self,
        send: F,
        replayable: bool,
    ) -> Result<T, Failure>
    where
        F: Fn(WaitSend<C>) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        match (self.wait, &self.link.waits) {
            (Some(_), Some(waits)) => {
                let queue = self.options.deadline;
                waits
                    .send(&self.node.name, queue, replayable, |con| {
                        send(WaitSend::Own(con))
                    })
                    .await
            }
            _ => {
                self.sent(|con| send(WaitSend::Shared(con)), replayable)
                    .await
            }
        }
    }
}

/// The connection a call that may wait is sent on: one of its own, or the shared one.
pub(crate) enum WaitSend<C> {
    Own(redis::aio::MultiplexedConnection),
    Shared(C),
}

impl<C: ConnectionLike + Send> ConnectionLike for WaitSend<C> {
    fn req_packed_command<'a>(&'a mut self, command: &'a Cmd) -> redis::RedisFuture<'a, Value> {
        match self {
            WaitSend::Own(con) => con.req_packed_command(command),
            WaitSend::Shared(con) => con.req_packed_command(command),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<Value>> {
        match self {
            WaitSend::Own(con) => con.req_packed_commands(pipeline, offset, count),
            WaitSend::Shared(con) => con.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            WaitSend::Own(con) => con.get_db(),
            WaitSend::Shared(con) => con.get_db(),
        }
    }
}

/// Reads the slot table with `CLUSTER SLOTS` (the cluster connection sends it to any
/// node) within the deadline.
async fn read_table<C: ConnectionLike + Send>(mut con: C, shared: Arc<Shared>, deadline: Duration) {
    let reply = tokio::time::timeout(
        deadline,
        cmd("CLUSTER").arg("SLOTS").query_async::<Value>(&mut con),
    )
    .await;
    let mut topology = lock(&shared.topology);
    match reply {
        Ok(Ok(reply)) => match parse_slots(&reply) {
            Some(ranges) => topology.learned(ranges, Instant::now()),
            None => topology.refresh_failed(Instant::now()),
        },
        // A server without cluster support, or a user without CLUSTER: one node.
        Ok(Err(error))
            if error.to_string().contains("cluster support disabled")
                || error.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoPerm) =>
        {
            topology.single()
        }
        _ => topology.refresh_failed(Instant::now()),
    }
}

/// An unknown command where none was expected is an error like any other.
pub(crate) fn failure_error(failure: Failure) -> Error {
    match failure {
        Failure::UnknownCommand => Error::ModuleRequired,
        Failure::Error(error) => error,
    }
}

pub(crate) fn command(words: &[String]) -> Cmd {
    let mut command = Cmd::new();
    for word in words {
        command.arg(word);
    }
    command
}

fn invalid(error: ArgError) -> Error {
    let text = error.to_string();
    Error::InvalidArgument(text.strip_prefix("ERR ").unwrap_or(&text).to_owned())
}

/// Checks a command's words with the module's own parser before anything is sent.
pub(crate) fn check<T, S: AsRef<str>>(
    parse: impl FnOnce(&[&[u8]]) -> Result<T, ArgError>,
    words: &[S],
) -> Result<T, Error> {
    let bytes: Vec<&[u8]> = words.iter().map(|word| word.as_ref().as_bytes()).collect();
    parse(&bytes).map_err(invalid)
}
