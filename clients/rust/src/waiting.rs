//! Connections of their own for calls that wait (`WAIT ms`, see
//! [`Limiter::with_wait`](crate::Limiter::with_wait)): the server holds a waiting call's
//! reply, and every later call on its connection behind it, so a waiting call never
//! rides the limiter's shared (multiplexed) connection. It takes a connection to its
//! node from a bounded pool (at most [`Options::max_waiting`](crate::Options) in use at
//! once, the rest `Error::Busy`), and gives it back once answered; a wait cut short (its
//! deadline passed, or its future dropped: the request cancelled) closes its
//! connection, so the server gives back what the call was charged. On a cluster it
//! follows MOVED (the limiter's slot table patched), ASK and TRYAGAIN itself, as the
//! shared connections' router does.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, ConnectionInfo, RedisResult};
use tokio::sync::Semaphore;

use crate::cluster::Topology;
use crate::error::{classify, connection_spent, demoted, Error, Failure};
use crate::mutex::lock;
use crate::nodes::{next_after, Next, MOST_REDIRECTS, TRY_AGAIN_AFTER};

/// Where a node is: the limiter's settings (user, password, database, TLS) at its
/// address.
pub(crate) type Address = Box<dyn Fn(&str) -> RedisResult<ConnectionInfo> + Send + Sync>;

pub(crate) struct WaitConnections {
    address: Address,
    config: AsyncConnectionConfig,
    permits: Semaphore,
    /// Connections back from a call, by node.
    idle: Mutex<HashMap<String, Vec<MultiplexedConnection>>>,
    /// How many wait at most: a bound on the connections this pool keeps.
    most: usize,
    /// A cluster's slot table, patched by a MOVED reply (None on a single server).
    topology: Option<Arc<Mutex<Topology>>>,
}

/// A connection in a call's hands: given back to the pool when the call was answered,
/// else (cut short, dropped) closed with it.
struct Held<'a> {
    pool: &'a WaitConnections,
    node: &'a str,
    connection: Option<MultiplexedConnection>,
    answered: bool,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if let (true, Some(connection)) = (self.answered, self.connection.take()) {
            let mut idle = lock(&self.pool.idle);
            let kept = idle.entry(self.node.to_owned()).or_default();
            if kept.len() < self.pool.most {
                kept.push(connection);
            }
        }
    }
}

impl WaitConnections {
    /// At most `most` waiting calls at once, each connecting within `deadline`; on a
    /// cluster, `topology` is the limiter's slot table.
    pub(crate) fn new(
        address: Address,
        most: usize,
        deadline: Duration,
        topology: Option<Arc<Mutex<Topology>>>,
    ) -> WaitConnections {
        WaitConnections {
            address,
            // No response timeout: the call's own deadline (its wait and more) bounds it.
            config: AsyncConnectionConfig::new()
                .set_connection_timeout(Some(deadline))
                .set_response_timeout(None),
            permits: Semaphore::new(most),
            idle: Mutex::default(),
            most,
            topology,
        }
    }

    /// Sends `send` on a connection of its own to `node` ("" on a single server); a
    /// free place within `queue` (else `Error::Busy`: this process's overload). Sent
    /// once more on a fresh connection, the node's kept ones dropped: after READONLY (a
    /// primary demoted by a failover ran nothing, and the address may lead to the new
    /// one now; a second READONLY is the outage), and, when `replayable` (see
    /// `Limiter::query_replayable`), after a dropped connection: a restart leaves every
    /// kept connection dead, and a call meeting one is no outage. On a cluster, a
    /// MOVED reply patches the slot table and sends the call to the slot's owner, ASK
    /// to the node named after ASKING, TRYAGAIN again 10 ms later (16 times at most;
    /// the call's deadline bounds them all).
    pub(crate) async fn send<T, F, Fut>(
        &self,
        node: &str,
        queue: Duration,
        replayable: bool,
        send: F,
    ) -> Result<T, Failure>
    where
        F: Fn(MultiplexedConnection) -> Fut,
        Fut: std::future::Future<Output = RedisResult<T>>,
    {
        let _permit = match tokio::time::timeout(queue, self.permits.acquire()).await {
            Ok(Ok(permit)) => permit,
            _ => {
                return Err(Failure::Error(Error::Busy(format!(
                    "no connection for a waiting call free within {queue:?}: {} wait already",
                    self.most
                ))))
            }
        };
        let (mut node, mut asking) = (node.to_owned(), false);
        let (mut redirects, mut resent) = (0, false);
        loop {
            let answer = self.send_once(&node, asking, &send).await;
            asking = false;
            let Err(error) = &answer else {
                return answer.map_err(|error| classify(&error));
            };
            if redirects < MOST_REDIRECTS {
                redirects += 1;
                match next_after(error) {
                    Next::Moved { slot, node: owner } => {
                        if let Some(topology) = &self.topology {
                            lock(topology).slot_moved(slot, &owner);
                        }
                        node = owner;
                        continue;
                    }
                    Next::Ask { node: target } => {
                        (node, asking) = (target, true);
                        continue;
                    }
                    Next::TryAgain => {
                        tokio::time::sleep(TRY_AGAIN_AFTER).await;
                        continue;
                    }
                    Next::Done => {}
                }
            }
            let dropped = replayable && error.is_connection_dropped() && !error.is_timeout();
            if !resent && (demoted(error) || dropped) {
                log::debug!(target: "qag_client", "once more on a new connection after: {error}");
                lock(&self.idle).remove(&node);
                resent = true;
                continue;
            }
            return answer.map_err(|error| classify(&error));
        }
    }

    /// `send` on a kept connection to `node`, or a new one (after ASKING when
    /// `asking`: the connection is the call's alone).
    async fn send_once<T, F, Fut>(&self, node: &str, asking: bool, send: &F) -> RedisResult<T>
    where
        F: Fn(MultiplexedConnection) -> Fut,
        Fut: std::future::Future<Output = RedisResult<T>>,
    {
        let kept = lock(&self.idle).get_mut(node).and_then(Vec::pop);
        let connection = match kept {
            Some(connection) => connection,
            None => {
                redis::Client::open((self.address)(node)?)?
                    .get_multiplexed_async_connection_with_config(&self.config)
                    .await?
            }
        };
        let mut held = Held {
            pool: self,
            node,
            connection: Some(connection.clone()),
            answered: false,
        };
        let reply = if asking {
            let mut asked = connection.clone();
            match redis::cmd("ASKING").query_async::<()>(&mut asked).await {
                Ok(()) => send(connection).await,
                Err(error) => Err(error),
            }
        } else {
            send(connection).await
        };
        // An error reply leaves the connection as good as an answer; a failed one, or
        // one to a demoted primary, not.
        held.answered = reply
            .as_ref()
            .map_or_else(|error| !connection_spent(error), |_| true);
        reply
    }
}
