//! [`ClusterNodes`]: the limiter's own connection to a Redis Cluster. Each call goes to
//! the primary that owns its key's slot in the limiter's slot table (`cluster::Topology`,
//! read with `CLUSTER SLOTS`), on one multiplexed connection per node, and MOVED, ASK
//! and TRYAGAIN are followed call by call. The redis crate's cluster connection keeps
//! sending a stopped primary's slots to it (a timeout never makes it read the slots
//! again) and stalls redirected calls that run at once; routed by the table the limiter
//! reads again after a failure, a replica that took over serves as soon as the cluster
//! names it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::{
    Arg, AsyncConnectionConfig, Cmd, ConnectionAddr, ConnectionInfo, ErrorKind, IntoConnectionInfo,
    Pipeline, RedisError, RedisFuture, RedisResult, ServerErrorKind, Value,
};

use crate::cluster::{routing_key, slot_of, Topology};
use crate::error::connection_spent;
use crate::mutex::lock;

/// Redirects one call follows before it gives up (a slot moving back and forth).
pub(crate) const MOST_REDIRECTS: usize = 16;
/// How long a TRYAGAIN (the keys of a call split by a migration) waits for the next try.
pub(crate) const TRY_AGAIN_AFTER: Duration = Duration::from_millis(10);
/// A call without a key (`CLUSTER SLOTS`) goes to this many nodes at once, those that
/// failed last asked last; the first answer is taken.
const KEYLESS_FAN_OUT: usize = 3;

/// A connection to every primary of a Redis Cluster, routing each call by its key:
/// give it to [`crate::Limiter::connect_cluster`]. Cheap to clone (clones share the
/// connections and the slot table).
#[derive(Clone)]
pub struct ClusterNodes {
    router: Arc<Router>,
    /// The node this handle last called: a call without a key that follows (SCRIPT LOAD
    /// after a NOSCRIPT) goes there, where the script is to run.
    last_node: Option<String>,
}

type NodeConnection = Arc<tokio::sync::Mutex<Option<MultiplexedConnection>>>;

struct Router {
    /// The first seed's settings (user, password, database, protocol) for every node.
    settings: ConnectionInfo,
    seeds: Vec<String>,
    topology: Arc<Mutex<Topology>>,
    config: AsyncConnectionConfig,
    connections: Mutex<HashMap<String, NodeConnection>>,
    /// When each node last failed or left a call unanswered.
    failed_at: Mutex<HashMap<String, Instant>>,
}

impl std::fmt::Debug for ClusterNodes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterNodes")
            .field("seeds", &self.router.seeds)
            .finish_non_exhaustive()
    }
}

impl ClusterNodes {
    /// Connections to the cluster that `seeds` (`redis://…` URLs of some of its nodes,
    /// the first one's user and password used for all) belong to, made when first
    /// needed, each bounded by `timeout` (connecting, and every reply).
    pub fn new<T: IntoConnectionInfo>(seeds: Vec<T>, timeout: Duration) -> RedisResult<Self> {
        let mut settings = None;
        let mut addresses = Vec::new();
        for seed in seeds {
            let info = seed.into_connection_info()?;
            addresses.push(address_of(info.addr())?);
            settings.get_or_insert(info);
        }
        let settings = settings.ok_or_else(|| {
            RedisError::from((ErrorKind::InvalidClientConfig, "no seed node given"))
        })?;
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout));
        Ok(ClusterNodes {
            router: Arc::new(Router {
                settings,
                seeds: addresses,
                topology: Arc::new(Mutex::new(Topology::default())),
                config,
                connections: Mutex::new(HashMap::new()),
                failed_at: Mutex::new(HashMap::new()),
            }),
            last_node: None,
        })
    }

    /// PING to `node` (`host:port`), on its connection: whether that node answers (the
    /// probe after its back-off).
    /// `node` is "" while the slot table is unknown: the calls go to the first seed
    /// then, and so does the probe.
    pub(crate) async fn ping(&self, node: &str) -> RedisResult<()> {
        let node = if node.is_empty() {
            &self.router.seeds[0]
        } else {
            node
        };
        let (_, reply) = self
            .router
            .routed(node.to_owned(), send_command(redis::cmd("PING")), |_| {
                Next::Done
            })
            .await;
        reply.map(drop)
    }

    /// Where each node is for a connection of its own (a waiting call's): the first
    /// seed's settings at the node's address (the first seed's own while the slot table
    /// is not known).
    pub(crate) fn address(&self) -> crate::waiting::Address {
        let (settings, first) = (self.router.settings.clone(), self.router.seeds[0].clone());
        Box::new(move |node| {
            let node = if node.is_empty() {
                first.as_str()
            } else {
                node
            };
            let (host, port) = node
                .rsplit_once(':')
                .and_then(|(host, port)| Some((host, port.parse::<u16>().ok()?)))
                .ok_or_else(|| {
                    RedisError::from((
                        ErrorKind::Parse,
                        "a node address",
                        format!("{node:?} is not host:port"),
                    ))
                })?;
            Ok(settings
                .clone()
                .set_addr(ConnectionAddr::Tcp(host.to_owned(), port)))
        })
    }

    /// The slot table, shared with the limiter that reads it.
    pub(crate) fn topology(&self) -> Arc<Mutex<Topology>> {
        self.router.topology.clone()
    }
}

fn address_of(addr: &ConnectionAddr) -> RedisResult<String> {
    match addr {
        ConnectionAddr::Tcp(host, port) => Ok(format!("{host}:{port}")),
        _ => Err(RedisError::from((
            ErrorKind::InvalidClientConfig,
            "a cluster node needs a redis:// (TCP) address",
        ))),
    }
}

/// Marks its node as failed unless the call it guards got an answer (a call cut off by
/// the limiter's deadline is dropped while it waits).
struct Unanswered<'a> {
    router: &'a Router,
    node: &'a str,
    answered: bool,
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if !self.answered {
            lock(&self.router.failed_at).insert(self.node.to_owned(), Instant::now());
        }
    }
}

/// Where a reply sends the call next.
pub(crate) enum Next {
    Done,
    /// MOVED: the slot's owner is `node` now.
    Moved {
        slot: u16,
        node: String,
    },
    /// ASK: this call only, to `node`, after ASKING.
    Ask {
        node: String,
    },
    TryAgain,
}

/// Where a command's reply sends it: an error reply is a value until the caller reads it.
fn next_after_reply(reply: &RedisResult<Value>) -> Next {
    match reply {
        Err(error) => next_after(error),
        Ok(Value::ServerError(error)) => next_after(&RedisError::from(error.clone())),
        Ok(_) => Next::Done,
    }
}

pub(crate) fn next_after(error: &RedisError) -> Next {
    match error.kind() {
        ErrorKind::Server(ServerErrorKind::Moved) => match error.redirect_node() {
            Some((node, slot)) => Next::Moved {
                slot,
                node: node.to_owned(),
            },
            None => Next::Done,
        },
        ErrorKind::Server(ServerErrorKind::Ask) => match error.redirect_node() {
            Some((node, _)) => Next::Ask {
                node: node.to_owned(),
            },
            None => Next::Done,
        },
        ErrorKind::Server(ServerErrorKind::TryAgain) => Next::TryAgain,
        _ => Next::Done,
    }
}

/// The redirect in a pipeline's replies, if one of them is one.
fn next_after_replies(replies: &RedisResult<Vec<Value>>) -> Next {
    match replies {
        Err(error) => next_after(error),
        Ok(values) => values
            .iter()
            .find_map(|value| match value {
                Value::ServerError(_) => match next_after_reply(&Ok(value.clone())) {
                    Next::Done => None,
                    next => Some(next),
                },
                _ => None,
            })
            .unwrap_or(Next::Done),
    }
}

fn words(command: &Cmd) -> Vec<&[u8]> {
    command
        .args_iter()
        .filter_map(|arg| match arg {
            Arg::Simple(word) => Some(word),
            _ => None,
        })
        .collect()
}

impl Router {
    /// The node owning `key`'s slot; a seed while the table is not known.
    fn owner(&self, key: &[u8]) -> String {
        let owner = lock(&self.topology).owner(slot_of(key)).map(str::to_owned);
        owner.unwrap_or_else(|| self.seeds[0].clone())
    }

    async fn connection(&self, node: &str) -> RedisResult<MultiplexedConnection> {
        let slot = {
            let mut connections = lock(&self.connections);
            match connections.get(node) {
                Some(slot) => slot.clone(),
                // The name is copied only the first time: every call looks its node up.
                None => connections.entry(node.to_owned()).or_default().clone(),
            }
        };
        let mut slot = slot.lock().await;
        if let Some(connection) = slot.as_ref() {
            return Ok(connection.clone());
        }
        let (host, port) = node
            .rsplit_once(':')
            .and_then(|(host, port)| Some((host, port.parse::<u16>().ok()?)))
            .ok_or_else(|| {
                RedisError::from((
                    ErrorKind::Parse,
                    "a node address",
                    format!("{node:?} is not host:port"),
                ))
            })?;
        let info = self
            .settings
            .clone()
            .set_addr(ConnectionAddr::Tcp(host.to_owned(), port));
        let connection = redis::Client::open(info)?
            .get_multiplexed_async_connection_with_config(&self.config)
            .await?;
        *slot = Some(connection.clone());
        Ok(connection)
    }

    /// A node that dropped a connection, failed to connect, or answered READONLY (a
    /// primary demoted, the address maybe moved): the next call makes a new connection.
    fn failed(&self, node: &str, error: &RedisError) {
        if connection_spent(error) {
            lock(&self.connections).remove(node);
            lock(&self.failed_at).insert(node.to_owned(), Instant::now());
        }
    }

    /// A reply that is a READONLY error (the caller reads it as one).
    fn failed_in<T: ReplyValue>(&self, node: &str, reply: &T) {
        if let Some(error) = reply.read_only() {
            self.failed(node, &error);
        }
    }

    /// Sends `send` to `node`, then where its replies redirect it.
    async fn routed<T: ReplyValue>(
        &self,
        mut node: String,
        send: impl Fn(MultiplexedConnection, bool) -> RedisFuture<'static, T>,
        redirect: impl Fn(&RedisResult<T>) -> Next,
    ) -> (String, RedisResult<T>) {
        let mut asking = false;
        for _ in 0..MOST_REDIRECTS {
            let connection = match self.connection(&node).await {
                Ok(connection) => connection,
                Err(error) => {
                    self.failed(&node, &error);
                    return (node, Err(error));
                }
            };
            let mut unanswered = Unanswered {
                router: self,
                node: &node,
                answered: false,
            };
            let reply = send(connection, asking).await;
            unanswered.answered = true;
            drop(unanswered);
            match &reply {
                Err(error) => self.failed(&node, error),
                Ok(value) => self.failed_in(&node, value),
            }
            asking = false;
            match redirect(&reply) {
                Next::Done => return (node, reply),
                Next::Moved { slot, node: owner } => {
                    lock(&self.topology).slot_moved(slot, &owner);
                    node = owner;
                }
                Next::Ask { node: target } => {
                    node = target;
                    asking = true;
                }
                Next::TryAgain => tokio::time::sleep(TRY_AGAIN_AFTER).await,
            }
        }
        let error = RedisError::from((
            ErrorKind::Client,
            "too many cluster redirects",
            format!("more than {MOST_REDIRECTS}, the last to {node}"),
        ));
        (node, Err(error))
    }

    /// Nodes for a call without a key: the table's primaries and the seeds, those that
    /// failed least recently first.
    fn keyless_nodes(&self) -> Vec<String> {
        let mut nodes = lock(&self.topology).primaries();
        for seed in &self.seeds {
            if !nodes.contains(seed) {
                nodes.push(seed.clone());
            }
        }
        let failed_at = lock(&self.failed_at);
        nodes.sort_by_key(|node| failed_at.get(node).copied());
        nodes.truncate(KEYLESS_FAN_OUT);
        nodes
    }
}

/// A command's reply or a pipeline's replies, looked through for READONLY.
trait ReplyValue {
    fn read_only(&self) -> Option<RedisError>;
}

impl ReplyValue for Value {
    fn read_only(&self) -> Option<RedisError> {
        match self {
            Value::ServerError(error) if error.kind() == Some(ServerErrorKind::ReadOnly) => {
                Some(RedisError::from(error.clone()))
            }
            _ => None,
        }
    }
}

impl ReplyValue for Vec<Value> {
    fn read_only(&self) -> Option<RedisError> {
        self.iter().find_map(Value::read_only)
    }
}

fn send_command(
    command: Cmd,
) -> impl Fn(MultiplexedConnection, bool) -> RedisFuture<'static, Value> {
    move |mut connection, asking| {
        let command = command.clone();
        Box::pin(async move {
            if asking {
                let mut pipeline = redis::pipe();
                pipeline.cmd("ASKING").ignore().add_command(command);
                let mut replies: Vec<Value> = pipeline.query_async(&mut connection).await?;
                replies
                    .pop()
                    .ok_or_else(|| RedisError::from((ErrorKind::Parse, "no reply after ASKING")))
            } else {
                connection.req_packed_command(&command).await
            }
        })
    }
}

fn send_pipeline(
    pipeline: Pipeline,
    offset: usize,
    count: usize,
) -> impl Fn(MultiplexedConnection, bool) -> RedisFuture<'static, Vec<Value>> {
    move |mut connection, asking| {
        let pipeline = pipeline.clone();
        Box::pin(async move {
            if asking {
                // ASKING holds for the next command only: one before each.
                let mut asked = redis::pipe();
                for command in pipeline.cmd_iter() {
                    asked.cmd("ASKING").add_command(command.clone());
                }
                let replies = connection
                    .req_packed_commands(&asked, offset * 2, count * 2)
                    .await?;
                Ok(replies.into_iter().skip(1).step_by(2).collect())
            } else {
                connection
                    .req_packed_commands(&pipeline, offset, count)
                    .await
            }
        })
    }
}

impl ClusterNodes {
    async fn command(&mut self, command: &Cmd) -> RedisResult<Value> {
        let send = send_command(command.clone());
        let node = match routing_key(&words(command)) {
            Some(key) => self.router.owner(key),
            None => match self.last_node.clone() {
                Some(node) => node,
                None => return self.keyless(command).await,
            },
        };
        let (node, reply) = self.router.routed(node, send, next_after_reply).await;
        self.last_node = Some(node);
        reply
    }

    /// A call without a key and no node to follow: to a few nodes at once, the first
    /// answer taken (the others are dropped).
    async fn keyless(&mut self, command: &Cmd) -> RedisResult<Value> {
        let mut calls = tokio::task::JoinSet::new();
        for node in self.router.keyless_nodes() {
            let router = self.router.clone();
            let command = command.clone();
            calls.spawn(async move {
                let send = send_command(command);
                router.routed(node, send, next_after_reply).await
            });
        }
        let mut last = Err(RedisError::from((
            ErrorKind::ClusterConnectionNotFound,
            "no cluster node to ask",
        )));
        while let Some(joined) = calls.join_next().await {
            match joined {
                Ok((_, Ok(value))) => return Ok(value),
                Ok((_, Err(error))) => last = Err(error),
                Err(_) => {}
            }
        }
        last
    }

    async fn pipeline(
        &mut self,
        pipeline: &Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        let key = pipeline
            .cmd_iter()
            .find_map(|command| routing_key(&words(command)).map(<[u8]>::to_vec));
        let node = match (key, self.last_node.clone()) {
            (Some(key), _) => self.router.owner(&key),
            (None, Some(node)) => node,
            (None, None) => self.router.seeds[0].clone(),
        };
        let send = send_pipeline(pipeline.clone(), offset, count);
        let (node, replies) = self.router.routed(node, send, next_after_replies).await;
        self.last_node = Some(node);
        replies
    }
}

impl ConnectionLike for ClusterNodes {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(self.command(cmd))
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(self.pipeline(pipeline, offset, count))
    }

    fn get_db(&self) -> i64 {
        0
    }
}
