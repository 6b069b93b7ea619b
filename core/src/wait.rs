//! Waiting instead of a refusal: `WAIT ms` on QAG.TAKE, QAG.TAKE2, QAG.THROTTLE and
//! QAG.LEASE. A call that does not fit now but would within `ms` is held by the server
//! and answered when it fits; waiters of one key are served in the order they arrived.
//! The arithmetic of each family is in its own file (`bucket::take_waiting`,
//! `throttle::throttle_waiting`); here are the bounds every family shares and the
//! option's parser.

use crate::args::{set_once, ArgError, ArgList, Args};

/// The longest wait one call may ask for: a minute, longer than a gateway's request
/// should ever be held, and what bounds how far ahead a bucket or a throttle can be
/// charged by its waiters.
pub const MAX_WAIT_MS: i64 = 60_000;
/// [`MAX_WAIT_MS`] in seconds.
pub const MAX_WAIT_SECONDS: f64 = (MAX_WAIT_MS / 1000) as f64;
/// The most clients one server keeps waiting by default (load argument `MAX-WAITERS`);
/// beyond it a call with WAIT answers at once, as without.
pub const DEFAULT_MAX_WAITERS: i64 = 10_000;
/// The largest MAX-WAITERS.
pub const MAX_MAX_WAITERS: i64 = 1_000_000;

/// `WAIT ms` once the word is read: its milliseconds, 0 to [`MAX_WAIT_MS`], set once
/// into `slot`.
pub fn parse_wait<L: ArgList + ?Sized>(
    args: &mut Args<'_, L>,
    slot: &mut Option<i64>,
) -> Result<(), ArgError> {
    if args.remaining() == 0 {
        return Err(ArgError::Invalid("WAIT needs a number of milliseconds"));
    }
    let ms = args.integer("WAIT", 0, MAX_WAIT_MS)?;
    set_once(slot, ms, "WAIT")
}

/// Whole milliseconds of a wait of `micros`, rounded up: a waiter is never answered
/// before its time.
pub fn millis_up(micros: i64) -> i64 {
    micros.div_euclid(1000) + i64::from(micros.rem_euclid(1000) != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(words: &[&str]) -> Result<Option<i64>, String> {
        let list: Vec<&[u8]> = std::iter::once("cmd")
            .chain(words.iter().copied())
            .map(str::as_bytes)
            .collect();
        let mut args = Args::new(&list[..]);
        let mut slot = None;
        while args.remaining() > 0 {
            args.option(&["WAIT"], "WAIT ms")
                .map_err(|e| e.to_string())?;
            parse_wait(&mut args, &mut slot).map_err(|e| e.to_string())?;
        }
        Ok(slot)
    }

    #[test]
    fn wait_takes_whole_milliseconds_up_to_a_minute_once() {
        assert_eq!(parse(&["WAIT", "0"]), Ok(Some(0)));
        assert_eq!(parse(&["wait", "60000"]), Ok(Some(60_000)));
        let range = Err("ERR WAIT must be an integer from 0 to 60000".to_string());
        for bad in ["-1", "60001", "1.5", "ms", ""] {
            assert_eq!(parse(&["WAIT", bad]), range, "{bad:?}");
        }
        assert_eq!(
            parse(&["WAIT"]),
            Err("ERR WAIT needs a number of milliseconds".to_string())
        );
        assert_eq!(
            parse(&["WAIT", "5", "WAIT", "5"]),
            Err("ERR WAIT given more than once".to_string())
        );
    }

    #[test]
    fn waits_round_up_to_the_millisecond() {
        assert_eq!(millis_up(0), 0);
        assert_eq!(millis_up(1), 1);
        assert_eq!(millis_up(1000), 1);
        assert_eq!(millis_up(1001), 2);
    }
}
