//! The module's load arguments, `loadmodule libqag.so [CL-THROTTLE] [TEST-COMMANDS]
//! [THROTTLE-SKEW seconds] [ID-SECONDS seconds] [ID-MAX n] [MAX-WAITERS n]`, read with
//! the commands' own parser: words in any order, case-insensitive, each once; anything
//! else refuses the load.

use crate::args::{set_once, ArgError, Args};
use crate::replay::{DEFAULT_ID_MAX, DEFAULT_ID_SECONDS};
use crate::wait::{DEFAULT_MAX_WAITERS, MAX_MAX_WAITERS};

/// How far beyond a limiter's burst window a stored THROTTLE time is trusted by
/// default: clocks of a primary and its replicas differ by far less, and a TAT ahead
/// by more (a clock stepped far forward, a stray write) locks the limiter at most this
/// long beyond its burst window.
pub const DEFAULT_THROTTLE_SKEW_SECONDS: i64 = 60;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadOptions {
    /// Register CL.THROTTLE, redis-cell's name, too.
    pub cl_throttle: bool,
    /// Register the commands that exist for tests only (QAG.TEST.PANIC).
    pub test_commands: bool,
    /// THROTTLE-SKEW: seconds a stored TAT may lie beyond the burst window.
    pub throttle_skew_seconds: i64,
    /// ID-SECONDS: how long a request id is remembered.
    pub id_seconds: i64,
    /// ID-MAX: the most request ids one key remembers.
    pub id_max: i64,
    /// MAX-WAITERS: the most clients the server keeps waiting (0: none ever waits).
    pub max_waiters: i64,
}

/// The longest ID-SECONDS: a day, the shortest time a quota key outlives its period.
pub const MAX_ID_SECONDS: i64 = 86_400;
/// The largest ID-MAX.
pub const MAX_ID_MAX: i64 = 1_000_000;

/// The load arguments as the server passed them (none is the module's path).
pub fn parse_load_args(list: &[&[u8]]) -> Result<LoadOptions, ArgError> {
    // The parser's cursor starts after a command name: give it one.
    let mut words: Vec<&[u8]> = vec![b"loadmodule"];
    words.extend_from_slice(list);
    let mut args = Args::new(&words[..]);
    let (mut cl_throttle, mut test_commands, mut skew) = (None, None, None);
    let (mut id_seconds, mut id_max, mut max_waiters) = (None, None, None);
    let expected = "CL-THROTTLE, TEST-COMMANDS, THROTTLE-SKEW seconds, ID-SECONDS seconds, \
         ID-MAX n or MAX-WAITERS n";
    let options = [
        "CL-THROTTLE",
        "TEST-COMMANDS",
        "THROTTLE-SKEW",
        "ID-SECONDS",
        "ID-MAX",
        "MAX-WAITERS",
    ];
    while let Some(option) = args.option(&options, expected)? {
        let name = options[option];
        if option >= 2 && args.remaining() == 0 {
            return Err(ArgError::Invalid(match option {
                2 => "THROTTLE-SKEW needs a number of seconds",
                3 => "ID-SECONDS needs a number of seconds",
                4 => "ID-MAX needs a number",
                _ => "MAX-WAITERS needs a number",
            }));
        }
        match option {
            0 => set_once(&mut cl_throttle, true, name)?,
            1 => set_once(&mut test_commands, true, name)?,
            2 => set_once(&mut skew, args.integer(name, 0, i64::MAX)?, name)?,
            3 => set_once(
                &mut id_seconds,
                args.integer(name, 1, MAX_ID_SECONDS)?,
                name,
            )?,
            4 => set_once(&mut id_max, args.integer(name, 1, MAX_ID_MAX)?, name)?,
            _ => set_once(
                &mut max_waiters,
                args.integer(name, 0, MAX_MAX_WAITERS)?,
                name,
            )?,
        }
    }
    Ok(LoadOptions {
        cl_throttle: cl_throttle.unwrap_or(false),
        test_commands: test_commands.unwrap_or(false),
        throttle_skew_seconds: skew.unwrap_or(DEFAULT_THROTTLE_SKEW_SECONDS),
        id_seconds: id_seconds.unwrap_or(DEFAULT_ID_SECONDS),
        id_max: id_max.unwrap_or(DEFAULT_ID_MAX),
        max_waiters: max_waiters.unwrap_or(DEFAULT_MAX_WAITERS),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<LoadOptions, String> {
        let words: Vec<&[u8]> = text.split_whitespace().map(str::as_bytes).collect();
        parse_load_args(&words).map_err(|e| e.to_string())
    }

    #[test]
    fn none_is_the_defaults() {
        assert_eq!(
            parse(""),
            Ok(LoadOptions {
                cl_throttle: false,
                test_commands: false,
                throttle_skew_seconds: 60,
                id_seconds: 300,
                id_max: 1000,
                max_waiters: 10_000,
            })
        );
    }

    #[test]
    fn max_waiters_is_a_count_from_zero() {
        assert_eq!(parse("MAX-WAITERS 0").map(|o| o.max_waiters), Ok(0));
        assert_eq!(parse("max-waiters 500").map(|o| o.max_waiters), Ok(500));
        assert_eq!(
            parse("MAX-WAITERS"),
            Err("ERR MAX-WAITERS needs a number".to_string())
        );
        assert_eq!(
            parse("MAX-WAITERS 1000001"),
            Err("ERR MAX-WAITERS must be an integer from 0 to 1000000".to_string())
        );
    }

    #[test]
    fn words_in_any_order_and_case() {
        assert_eq!(
            parse("throttle-skew 5 CL-THROTTLE test-commands"),
            Ok(LoadOptions {
                cl_throttle: true,
                test_commands: true,
                throttle_skew_seconds: 5,
                id_seconds: 300,
                id_max: 1000,
                max_waiters: 10_000,
            })
        );
        assert_eq!(
            parse("THROTTLE-SKEW 0").map(|o| o.throttle_skew_seconds),
            Ok(0)
        );
        assert_eq!(
            parse("id-max 10 ID-SECONDS 60").map(|o| (o.id_seconds, o.id_max)),
            Ok((60, 10))
        );
        assert_eq!(
            parse("THROTTLE-SKEW 9223372036854775807").map(|o| o.throttle_skew_seconds),
            Ok(i64::MAX)
        );
    }

    #[test]
    fn anything_else_is_refused() {
        for (text, error) in [
            (
                "THROTTLE-SKEW",
                "ERR THROTTLE-SKEW needs a number of seconds",
            ),
            (
                "THROTTLE-SKEW -1",
                "ERR THROTTLE-SKEW must be an integer from 0 to 9223372036854775807",
            ),
            (
                "THROTTLE-SKEW 1.5",
                "ERR THROTTLE-SKEW must be an integer from 0 to 9223372036854775807",
            ),
            (
                "THROTTLE-SKEW 1 THROTTLE-SKEW 1",
                "ERR THROTTLE-SKEW given more than once",
            ),
            ("ID-SECONDS", "ERR ID-SECONDS needs a number of seconds"),
            (
                "ID-SECONDS 0",
                "ERR ID-SECONDS must be an integer from 1 to 86400",
            ),
            ("ID-MAX 0", "ERR ID-MAX must be an integer from 1 to 1000000"),
            ("ID-MAX 5 ID-MAX 5", "ERR ID-MAX given more than once"),
            (
                "CL-THROTTLE CL-THROTTLE",
                "ERR CL-THROTTLE given more than once",
            ),
            (
                "CL-THROTTLE 5",
                "ERR syntax error: expected CL-THROTTLE, TEST-COMMANDS, THROTTLE-SKEW seconds, ID-SECONDS seconds, ID-MAX n or MAX-WAITERS n",
            ),
            (
                "SKEW 5",
                "ERR syntax error: expected CL-THROTTLE, TEST-COMMANDS, THROTTLE-SKEW seconds, ID-SECONDS seconds, ID-MAX n or MAX-WAITERS n",
            ),
        ] {
            assert_eq!(parse(text).err().as_deref(), Some(error), "{text}");
        }
    }
}
