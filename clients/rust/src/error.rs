//! The crate's errors, and how a Redis error becomes one. None of them is ever turned
//! into "allowed" by the crate: what to do is the caller's choice.

use redis::{ErrorKind, RedisError, ServerErrorKind};
use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

/// Why a call failed: the text, and the driver's error it came from, if any (for
/// `std::error::Error::source`). Compared by its text.
#[derive(Clone, Debug)]
pub struct Reason {
    text: String,
    source: Option<Arc<RedisError>>,
}

impl Reason {
    fn from_redis(error: &RedisError) -> Reason {
        Reason {
            text: error.to_string(),
            source: Some(Arc::new(error.clone())),
        }
    }
}

impl From<String> for Reason {
    fn from(text: String) -> Reason {
        Reason { text, source: None }
    }
}

impl From<&str> for Reason {
    fn from(text: &str) -> Reason {
        Reason::from(text.to_owned())
    }
}

impl Deref for Reason {
    type Target = str;

    fn deref(&self) -> &str {
        &self.text
    }
}

impl PartialEq for Reason {
    fn eq(&self, other: &Reason) -> bool {
        self.text == other.text
    }
}

impl Eq for Reason {}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Error {
    /// The server could not be reached, dropped the connection, or is not serving
    /// (loading, cluster down, no primary for the slot), or a back-off is running.
    Unavailable(Reason),
    /// No reply in time: within the limiter's per-call deadline, or the connection's
    /// own response timeout (redis-rs's default is also 0.5 s). Whether the server ran
    /// the command is unknown.
    Timeout,
    /// The server refused the command for this user (NOPERM): a configuration error,
    /// never read as a missing module.
    Permission(Reason),
    /// The backend is `Module` and the server does not have the module (with `Auto` and
    /// `Script`, every family's script answers instead).
    ModuleRequired,
    /// Arguments the module would refuse; nothing was sent.
    InvalidArgument(String),
    /// Any other error reply (e.g. WRONGTYPE, OOM), or a reply of an unexpected shape.
    Server(Reason),
    /// On a cluster, the keys of one call are in different slots: nothing was sent
    /// (the module would answer CROSSSLOT, the script would run them apart). Give them
    /// a common hash tag; for a pair, or choose [`CrossSlot::TwoCalls`](crate::CrossSlot).
    CrossSlot(String),
    /// A waiting call found no connection of the limiter's for waits free within its
    /// deadline ([`Options::max_waiting`](crate::Options) wait already): this process's
    /// back-pressure, never an outage (nothing was sent).
    Busy(String),
}

impl Error {
    /// Redis did not answer: the errors [`OnUnavailable::Local`](crate::OnUnavailable)
    /// answers locally.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Error::Unavailable(_) | Error::Timeout)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Unavailable(why) => write!(f, "redis is unavailable: {why}"),
            Error::Timeout => write!(f, "redis did not answer in time"),
            Error::Permission(why) => write!(f, "permission denied by the server: {why}"),
            Error::ModuleRequired => write!(
                f,
                "the qag module is required and the server does not have it"
            ),
            Error::InvalidArgument(why) => write!(f, "invalid argument: {why}"),
            Error::Server(why) => write!(f, "the server answered an error: {why}"),
            Error::CrossSlot(why) | Error::Busy(why) => write!(f, "{why}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Unavailable(reason) | Error::Permission(reason) | Error::Server(reason) => {
                let source = reason.source.as_deref()?;
                Some(source)
            }
            _ => None,
        }
    }
}

/// A Redis error, sorted by what the limiter does about it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The command does not exist on the server: the module is missing there.
    UnknownCommand,
    Error(Error),
}

/// A primary demoted by a failover, the connection still on it (READONLY): it ran
/// nothing.
pub(crate) fn demoted(error: &RedisError) -> bool {
    error.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly) || unblocked_by_demotion(error)
}

/// A waiting call the server let go as its primary became a replica (Redis 8: `UNBLOCKED
/// force unblock from blocking operation, instance state changed (master -> replica?)`):
/// a demotion, as READONLY is (found by the fault test on a cluster failing over; it was
/// a server error no policy answered). An admin's `CLIENT UNBLOCK … ERROR` is not one.
fn unblocked_by_demotion(error: &RedisError) -> bool {
    error.code() == Some("UNBLOCKED")
        && error
            .detail()
            .is_some_and(|detail| detail.contains("instance state changed"))
}

/// A connection that failed this way is of no more use: it broke, timed out, or
/// reaches a demoted primary.
pub(crate) fn connection_spent(error: &RedisError) -> bool {
    error.is_io_error() || error.is_connection_dropped() || error.is_timeout() || demoted(error)
}

pub(crate) fn classify(error: &RedisError) -> Failure {
    let reason = Reason::from_redis(error);
    match error.kind() {
        _ if error.is_timeout() => Failure::Error(Error::Timeout),
        ErrorKind::Server(ServerErrorKind::NoPerm) => Failure::Error(Error::Permission(reason)),
        // A primary demoted by a failover, this connection still on it: no write ran, and
        // the server serves none; an outage until a probe finds it (or its address) a
        // primary again.
        ErrorKind::Server(ServerErrorKind::ReadOnly) => Failure::Error(Error::Unavailable(reason)),
        _ if unblocked_by_demotion(error) => Failure::Error(Error::Unavailable(reason)),
        ErrorKind::Io
        | ErrorKind::ClusterConnectionNotFound
        | ErrorKind::Server(
            ServerErrorKind::BusyLoading
            | ServerErrorKind::ClusterDown
            | ServerErrorKind::MasterDown
            | ServerErrorKind::TryAgain,
        ) => Failure::Error(Error::Unavailable(reason)),
        _ if is_unknown_command(&reason) => Failure::UnknownCommand,
        _ => Failure::Error(Error::Server(reason)),
    }
}

/// What a probe's PING that failed says of its node: an outage's reply or no reply is
/// no answer, and neither is a failure of this side (a name that is no address, a
/// connection refused): only the server's own reply ends a back-off.
pub(crate) fn probe_failed(error: &RedisError) -> Result<(), Error> {
    match classify(error) {
        Failure::Error(error) if error.is_unavailable() => Err(error),
        _ if matches!(
            error.kind(),
            ErrorKind::Server(_) | ErrorKind::Extension | ErrorKind::AuthenticationFailed
        ) =>
        {
            Ok(())
        }
        _ => Err(Error::Unavailable(Reason::from_redis(error))),
    }
}

/// `url` as an error or a log line may print it: the user-info's password (all of it
/// when it has no `:`, since a redis URL may carry a password alone there) as `***`.
/// Everything before the last `@` is user-info, even where a raw `/` or `?` in a
/// password would end it for a URL parser: the strict side.
pub(crate) fn redacted(url: &str) -> String {
    let Some(at) = url.rfind('@') else {
        return url.to_owned();
    };
    let start = url.find("://").map_or(0, |scheme| scheme + 3).min(at);
    let user = url[start..at].split_once(':').map_or("", |(user, _)| user);
    let secret = if url[start..at].contains(':') {
        ":***"
    } else {
        "***"
    };
    format!("{}{user}{secret}{}", &url[..start], &url[at..])
}

/// Redis and Valkey answer `ERR unknown command 'qag.take', with args beginning with: ...`.
fn is_unknown_command(text: &str) -> bool {
    text.to_ascii_lowercase().contains("unknown command")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server_error(line: &str) -> RedisError {
        redis::parse_redis_value(format!("-{line}\r\n").as_bytes())
            .expect("an error reply parses")
            .extract_error()
            .expect_err("it is an error")
    }

    #[test]
    fn addresses_are_printed_without_their_secrets() {
        for (url, printed) in [
            (
                "redis://:hunter2@127.0.0.1:notaport/",
                "redis://:***@127.0.0.1:notaport/",
            ),
            (
                "rediss://alice:hunter2@h:6379/0",
                "rediss://alice:***@h:6379/0",
            ),
            ("redis://hunter2@h:6379", "redis://***@h:6379"),
            ("redis://a:b/c@d?e@h:1", "redis://a:***@h:1"),
            ("redis://h:6379/0", "redis://h:6379/0"),
            ("h:6379", "h:6379"),
            ("alice:hunter2@h", "alice:***@h"),
            ("redis://@h", "redis://***@h"),
        ] {
            assert_eq!(redacted(url), printed, "{url}");
        }
    }

    #[test]
    fn a_waiter_let_go_by_a_demotion_is_an_outage() {
        let demoted = server_error(
            "UNBLOCKED force unblock from blocking operation, instance state changed (master -> replica?)",
        );
        assert!(super::demoted(&demoted));
        assert!(matches!(
            classify(&demoted),
            Failure::Error(Error::Unavailable(_))
        ));
        let by_admin = server_error("UNBLOCKED client unblocked via CLIENT UNBLOCK");
        assert!(!super::demoted(&by_admin));
        assert!(matches!(
            classify(&by_admin),
            Failure::Error(Error::Server(_))
        ));
    }

    #[test]
    fn sorts_the_errors_a_server_answers() {
        let unknown =
            server_error("ERR unknown command 'qag.take', with args beginning with: 'k' '1' '1' ");
        assert_eq!(classify(&unknown), Failure::UnknownCommand);
        let noperm =
            server_error("NOPERM User limited has no permissions to run the 'evalsha' command");
        assert!(matches!(
            classify(&noperm),
            Failure::Error(Error::Permission(_))
        ));
        let loading = server_error("LOADING Redis is loading the dataset in memory");
        assert!(matches!(classify(&loading), Failure::Error(e) if e.is_unavailable()));
        let wrongtype =
            server_error("WRONGTYPE Operation against a key holding the wrong kind of value");
        let Failure::Error(error) = classify(&wrongtype) else {
            panic!("WRONGTYPE is a server error")
        };
        assert!(matches!(error, Error::Server(_)));
        let source = std::error::Error::source(&error).expect("the driver's error");
        assert!(source.to_string().contains("WRONGTYPE"));
        let io = RedisError::from(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "reset",
        ));
        assert!(matches!(
            classify(&io),
            Failure::Error(Error::Unavailable(_))
        ));
    }
}
