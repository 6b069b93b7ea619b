//! Concurrency slots held as leases: a sorted set of lease ids scored by their expiry in
//! Unix milliseconds. A lease is live while its expiry is after now; an expired lease is
//! a free slot, whoever held it.

use crate::args::{ArgError, ArgList, Args};
use crate::wait;

pub const MAX_SLOTS: i64 = 1_000_000;
/// The longest lease: seven days.
pub const MAX_TTL_MILLIS: i64 = 7 * 24 * 3600 * 1000;
pub const MAX_ID_BYTES: usize = 256;

/// Whether a lease expiring at `expiry_millis` still holds its slot at `now_millis`:
/// it expires after now, and no later than the longest lease given now could
/// (`latest_expiry`). A later expiry came from a clock far ahead or a stray write, not
/// from a lease this clock gave; it is no lease, so it locks no slot (a lease given by a
/// clock a little ahead, a failover to a primary whose clock is behind, still counts
/// unless it was within that step of the longest).
pub fn is_live(expiry_millis: f64, now_millis: i64) -> bool {
    expiry_millis > now_millis as f64 && expiry_millis <= latest_expiry(now_millis) as f64
}

/// Whether giving a lease the expiry `expiry_millis` changes its score `score` (None:
/// not there): a renewal to the expiry it has (twice within a millisecond) writes
/// nothing, nor replicates or signals.
pub fn moves(score: Option<f64>, expiry_millis: i64) -> bool {
    score != Some(expiry_millis as f64)
}

/// The latest expiry a lease given at `now_millis` can have: now + 7 days.
pub fn latest_expiry(now_millis: i64) -> i64 {
    now_millis.saturating_add(MAX_TTL_MILLIS)
}

/// What QAG.LEASE does, given the caller's lease and the number of live leases.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Acquire {
    /// The caller already holds a live lease: extend it; it still counts once.
    Renew,
    /// A slot is free: take it.
    Take,
    /// Every slot is held: change nothing.
    Refuse,
}

pub fn acquire(max: i64, live: u64, holds_live_lease: bool) -> Acquire {
    if holds_live_lease {
        Acquire::Renew
    } else if (live as i128) < i128::from(max) {
        Acquire::Take
    } else {
        Acquire::Refuse
    }
}

/// A lease id: non-empty, at most 256 bytes.
fn lease_id<L: ArgList + ?Sized>(args: &mut Args<'_, L>) -> Result<usize, ArgError> {
    let index = args.string()?;
    let len = args.bytes(index).len();
    if len == 0 || len > MAX_ID_BYTES {
        return Err(ArgError::Text {
            name: "id",
            rule: "non-empty and at most 256 bytes",
        });
    }
    Ok(index)
}

fn ttl<L: ArgList + ?Sized>(args: &mut Args<'_, L>) -> Result<i64, ArgError> {
    args.integer("ttl_ms", 1, MAX_TTL_MILLIS)
}

/// QAG.LEASE key max ttl_ms id [WAIT ms]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseArgs {
    pub key: usize,
    pub max: i64,
    pub ttl_millis: i64,
    pub id: usize,
    /// How long the caller would wait for a slot, in milliseconds, when given.
    pub wait: Option<i64>,
}

pub fn parse_lease<L: ArgList + ?Sized>(list: &L) -> Result<LeaseArgs, ArgError> {
    let mut args = Args::new(list);
    // Room for WAIT twice, so that is refused as such.
    args.expect_count(4, 8)?;
    let (key, max) = (args.key()?, args.integer("max", 1, MAX_SLOTS)?);
    let (ttl_millis, id) = (ttl(&mut args)?, lease_id(&mut args)?);
    let mut wait = None;
    while args.option(&["WAIT"], "WAIT ms")?.is_some() {
        wait::parse_wait(&mut args, &mut wait)?;
    }
    Ok(LeaseArgs {
        key,
        max,
        ttl_millis,
        id,
        wait,
    })
}

/// QAG.RENEW key id ttl_ms
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RenewArgs {
    pub key: usize,
    pub id: usize,
    pub ttl_millis: i64,
}

pub fn parse_renew<L: ArgList + ?Sized>(list: &L) -> Result<RenewArgs, ArgError> {
    let mut args = Args::new(list);
    args.expect_count(3, 3)?;
    Ok(RenewArgs {
        key: args.key()?,
        id: lease_id(&mut args)?,
        ttl_millis: ttl(&mut args)?,
    })
}

/// QAG.RELEASE key id
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReleaseArgs {
    pub key: usize,
    pub id: usize,
}

pub fn parse_release<L: ArgList + ?Sized>(list: &L) -> Result<ReleaseArgs, ArgError> {
    let mut args = Args::new(list);
    args.expect_count(2, 2)?;
    Ok(ReleaseArgs {
        key: args.key()?,
        id: lease_id(&mut args)?,
    })
}

/// QAG.LEASES key
pub fn parse_leases<L: ArgList + ?Sized>(list: &L) -> Result<usize, ArgError> {
    let mut args = Args::new(list);
    args.expect_count(1, 1)?;
    args.key()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(text: &str) -> Vec<&[u8]> {
        text.split(' ').map(str::as_bytes).collect()
    }

    #[test]
    fn live_means_expiring_after_now() {
        assert!(is_live(1001.0, 1000));
        assert!(!is_live(1000.0, 1000));
        assert!(!is_live(999.0, 1000));
        let latest = 1000 + MAX_TTL_MILLIS;
        assert!(is_live(latest as f64, 1000), "the longest lease");
        assert!(!is_live(latest as f64 + 1.0, 1000), "no lease given now");
        assert!(!is_live(f64::INFINITY, 1000));
        assert!(!is_live(f64::NAN, 1000));
        assert_eq!(latest_expiry(i64::MAX), i64::MAX);
    }

    #[test]
    fn a_renewal_to_the_same_expiry_moves_nothing() {
        assert!(moves(None, 1000));
        assert!(moves(Some(999.0), 1000));
        assert!(!moves(Some(1000.0), 1000));
    }

    #[test]
    fn acquire_renews_then_takes_then_refuses() {
        assert_eq!(
            acquire(3, 3, true),
            Acquire::Renew,
            "a retry never takes two slots"
        );
        assert_eq!(acquire(3, 0, false), Acquire::Take);
        assert_eq!(acquire(3, 2, false), Acquire::Take);
        assert_eq!(acquire(3, 3, false), Acquire::Refuse);
        assert_eq!(
            acquire(3, 7, false),
            Acquire::Refuse,
            "more live than max after max was lowered"
        );
        assert_eq!(acquire(1, u64::MAX, false), Acquire::Refuse);
    }

    #[test]
    fn lease_arguments() {
        let w = words("LEASE k 5 30000 req-1");
        assert_eq!(
            parse_lease(&w[..]),
            Ok(LeaseArgs {
                key: 1,
                max: 5,
                ttl_millis: 30000,
                id: 4,
                wait: None,
            })
        );
        let w = words("LEASE k 5 30000 req-1 wait 2500");
        assert_eq!(parse_lease(&w[..]).map(|a| a.wait), Ok(Some(2500)));
        let long_id = format!("LEASE k 5 30000 {}", "x".repeat(256));
        assert!(parse_lease(&words(&long_id)[..]).is_ok());
        for (text, error) in [
            ("LEASE k 5 30000", "ERR wrong number of arguments"),
            (
                "LEASE k 5 30000 id extra",
                "ERR syntax error: expected WAIT ms",
            ),
            (
                "LEASE k 5 30000 id WAIT 1 WAIT 1 x",
                "ERR wrong number of arguments",
            ),
            (
                "LEASE k 5 30000 id WAIT",
                "ERR WAIT needs a number of milliseconds",
            ),
            (
                "LEASE k 5 30000 id WAIT -5",
                "ERR WAIT must be an integer from 0 to 60000",
            ),
            (
                "LEASE k 5 30000 id WAIT 1 WAIT 1",
                "ERR WAIT given more than once",
            ),
            (
                "LEASE k 0 30000 id",
                "ERR max must be an integer from 1 to 1000000",
            ),
            (
                "LEASE k 1000001 30000 id",
                "ERR max must be an integer from 1 to 1000000",
            ),
            (
                "LEASE k 5 0 id",
                "ERR ttl_ms must be an integer from 1 to 604800000",
            ),
            (
                "LEASE k 5 604800001 id",
                "ERR ttl_ms must be an integer from 1 to 604800000",
            ),
            (
                "LEASE k 5 1.5 id",
                "ERR ttl_ms must be an integer from 1 to 604800000",
            ),
            (
                "LEASE k 5 100 ",
                "ERR id must be non-empty and at most 256 bytes",
            ),
        ] {
            let e = parse_lease(&words(text)[..]).unwrap_err().to_string();
            assert_eq!(e, error, "{text}");
        }
        let too_long = format!("LEASE k 5 30000 {}", "x".repeat(257));
        assert!(parse_lease(&words(&too_long)[..]).is_err());
    }

    #[test]
    fn renew_release_and_count_arguments() {
        assert_eq!(
            parse_renew(&words("RENEW k id 500")[..]),
            Ok(RenewArgs {
                key: 1,
                id: 2,
                ttl_millis: 500
            })
        );
        assert!(parse_renew(&words("RENEW k id -1")[..]).is_err());
        assert!(parse_renew(&words("RENEW k  500")[..]).is_err());
        assert_eq!(
            parse_release(&words("RELEASE k id")[..]),
            Ok(ReleaseArgs { key: 1, id: 2 })
        );
        assert!(parse_release(&words("RELEASE k")[..]).is_err());
        assert_eq!(parse_leases(&words("LEASES k")[..]), Ok(1));
        assert!(parse_leases(&words("LEASES k j")[..]).is_err());
    }
}
