//! Connections of their own for calls that wait (`WAIT ms`, see
//! [`Limiter::with_wait`](crate::Limiter::with_wait)): the server holds a waiting call's
//! reply, and every later call on its connection behind it, so a waiting call never
//! rides the limiter's shared (multiplexed) connection. It takes a connection to its
//! node from a bounded pool (at most [`Options::max_waiting`](crate::Options) in use at
//! once, the rest `Error::Busy`), and gives it back once answered; a wait cut short (its
//! deadline passed, or its future dropped: the request cancelled) closes its
//! connection, so the server gives back what the call was charged.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, ConnectionInfo, RedisResult};
use tokio::sync::Semaphore;

use crate::error::{classify, connection_spent, demoted, Error, Failure};
use crate::mutex::lock;

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
    /// At most `most` waiting calls at once, each connecting within `deadline`.
    pub(crate) fn new(address: Address, most: usize, deadline: Duration) -> WaitConnections {
        WaitConnections {
            address,
            // No response timeout: the call's own deadline (its wait and more) bounds it.
            config: AsyncConnectionConfig::new()
                .set_connection_timeout(Some(deadline))
                .set_response_timeout(None),
            permits: Semaphore::new(most),
            idle: Mutex::default(),
            most,
        }
    }

    /// Sends `send` on a connection of its own to `node` ("" on a single server); a
    /// free place within `queue` (else `Error::Busy`: this process's overload). Sent
    /// once more on a fresh connection, the node's kept ones dropped: after READONLY (a
    /// primary demoted by a failover ran nothing, and the address may lead to the new
    /// one now; a second READONLY is the outage), and, when `replayable` (see
    /// `Limiter::query_replayable`), after a dropped connection: a
    /// restart leaves every kept connection dead, and a call meeting one is no outage.
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
        let answer = match self.send_once(node, &send).await {
            Err(error) if demoted(&error) => {
                log::debug!(target: "qag_client", "a demoted primary, once more: {error}");
                lock(&self.idle).remove(node);
                self.send_once(node, &send).await
            }
            Err(error) if replayable && error.is_connection_dropped() && !error.is_timeout() => {
                log::debug!(target: "qag_client", "a dropped connection, once more: {error}");
                lock(&self.idle).remove(node);
                self.send_once(node, &send).await
            }
            answer => answer,
        };
        answer.map_err(|error| classify(&error))
    }

    /// `send` on a kept connection to `node`, or a new one.
    async fn send_once<T, F, Fut>(&self, node: &str, send: &F) -> RedisResult<T>
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
        let reply = send(connection).await;
        // An error reply leaves the connection as good as an answer; a failed one, or
        // one to a demoted primary, not.
        held.answered = reply
            .as_ref()
            .map_or_else(|error| !connection_spent(error), |_| true);
        reply
    }
}
