//! Replays that count once: a call given `ID request-id` leaves its reply in a field of
//! its own (first) key, `id:<command>:<request-id>`, with the time it is forgotten; the
//! same call repeated with that id while it is remembered answers the remembered reply
//! and changes nothing. Living in the key's own hash, an id is in the key's cluster slot,
//! under the caller's ACL key permissions, and replicated with the key's other fields.

use crate::args::{ArgError, ArgList, Args};

/// How long an id is remembered by default (load argument `ID-SECONDS`).
pub const DEFAULT_ID_SECONDS: i64 = 300;
/// The most ids a key keeps by default (load argument `ID-MAX`).
pub const DEFAULT_ID_MAX: i64 = 1000;
/// The longest request id, in bytes.
pub const MAX_ID_BYTES: usize = 128;

/// The prefix of every remembered id's field.
pub const FIELD_PREFIX: &[u8] = b"id:";

/// A reply as remembered: the shapes of the commands that take an id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    Integer(i64),
    Row(Vec<Option<i64>>),
    /// TAKE2's: the client bucket's row, then the key bucket's when it was counted.
    Pair(Vec<Option<i64>>, Option<Vec<Option<i64>>>),
}

/// The field that remembers `command`'s call with request id `id`, written into `out`
/// (a buffer the caller keeps from call to call). Each command has ids of its own, so
/// one request id serves every call a request makes.
pub fn field_name<'a>(out: &'a mut Vec<u8>, command: &str, id: &[u8]) -> &'a [u8] {
    out.clear();
    out.extend_from_slice(FIELD_PREFIX);
    out.extend_from_slice(command.as_bytes());
    out.push(b':');
    out.extend_from_slice(id);
    out
}

/// A reply to remember, borrowed from the reply itself (no copy of its rows).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AnswerRef<'a> {
    Integer(i64),
    Row(&'a [Option<i64>]),
    Pair(&'a [Option<i64>], Option<&'a [Option<i64>]>),
}

impl Answer {
    pub fn as_ref(&self) -> AnswerRef<'_> {
        match self {
            Answer::Integer(v) => AnswerRef::Integer(*v),
            Answer::Row(values) => AnswerRef::Row(values),
            Answer::Pair(first, second) => AnswerRef::Pair(first, second.as_deref()),
        }
    }
}

/// A remembered call: its reply, when it is forgotten, and, for an ADMIT that reserved,
/// its reservation (open, or committed: then what its partial charges paid).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub forget_at: i64,
    pub answer: Answer,
    pub hold: Option<Reserved>,
}

/// A reservation as its ADMIT remembers it: the tokens it still holds, until when (Unix
/// ms), on which chain of keys (`chain_of`: only a RECORD on that chain releases it),
/// what partial charges have charged so far (a commit charges the rest of its count),
/// and whether it was committed (then it holds nothing, and a RECORD that comes after,
/// a partial run late or a commit sent again, charges nothing: the commit's count
/// covered it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reserved {
    pub tokens: i64,
    pub until: i64,
    pub chain: i64,
    pub charged: i64,
    pub committed: bool,
}

impl Reserved {
    /// Whether it still holds tokens on its scopes at `now_millis`: not committed, some
    /// left, and ending after now but no later than `trusted_until`, the latest a hold
    /// the caller's clock trusts can end (`window::Clock::trusted_until`): a later end
    /// came from no real hold (a clock stepped far forward, a stray write), and holds
    /// nothing, as the scopes' own groups of it hold nothing.
    pub fn holds_at(&self, now_millis: i64, trusted_until: i64) -> bool {
        !self.committed && self.tokens > 0 && self.until > now_millis && self.until <= trusted_until
    }

    /// Whether forgetting it now would change a count: it still holds tokens, or, not
    /// yet committed, remembers what its partial charges paid (forgotten, its commit
    /// would charge those again).
    pub fn needed(&self, now_millis: i64, trusted_until: i64) -> bool {
        self.holds_at(now_millis, trusted_until) || !self.committed && self.charged > 0
    }
}

impl Record {
    /// When an ADMIT's record is forgotten once rewritten at `now_millis` by a charge
    /// under its reservation `hold` (a partial, or the commit): `id_millis` (ID-SECONDS)
    /// from now, so that a commit finds what partials paid and is itself remembered as
    /// long as any call, or when it was to be forgotten already, if later. That time may
    /// be the hold's end: for a hold ending after `trusted_until` (see
    /// [`Reserved::holds_at`]) it came from no real hold, and goes with it.
    pub fn forget_at_after_charge(
        &self,
        hold: &Reserved,
        now_millis: i64,
        id_millis: i64,
        trusted_until: i64,
    ) -> i64 {
        let kept = match hold.until <= trusted_until {
            true => self.forget_at,
            false => i64::MIN,
        };
        kept.max(now_millis.saturating_add(id_millis))
    }
}

/// A fingerprint of a chain of keys, in order (64-bit FNV-1a over each key and its
/// length).
pub fn chain_of<'a>(keys: impl Iterator<Item = &'a [u8]>) -> i64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |byte: u8| {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    };
    for key in keys {
        key.iter().copied().for_each(&mut eat);
        (key.len() as u64)
            .to_le_bytes()
            .into_iter()
            .for_each(&mut eat);
    }
    hash as i64
}

/// The text of a remembered call, written into `out` (a buffer the caller keeps):
/// `<forgotten at, Unix ms> <reply>[ h<tokens>,<until>,<chain>,<charged>]` (` c…` once
/// committed),
/// the reply as `i<n>`, `r<row>` or `p<row>;<row>` (an absent second row empty), a row's
/// values comma-separated, a null empty.
pub fn encode<'a>(
    out: &'a mut Vec<u8>,
    forget_at: i64,
    answer: AnswerRef<'_>,
    hold: Option<Reserved>,
) -> &'a [u8] {
    fn number(out: &mut Vec<u8>, v: i64) {
        match u8::try_from(v) {
            // Most of a reply's values: a flag, a retry of 0.
            Ok(digit @ 0..=9) => out.push(b'0' + digit),
            _ => out.extend_from_slice(itoa::Buffer::new().format(v).as_bytes()),
        }
    }
    fn row(out: &mut Vec<u8>, values: &[Option<i64>]) {
        for (i, value) in values.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            if let Some(v) = value {
                number(out, *v);
            }
        }
    }
    out.clear();
    out.reserve(64);
    number(out, forget_at);
    match answer {
        AnswerRef::Integer(v) => {
            out.extend_from_slice(b" i");
            number(out, v);
        }
        AnswerRef::Row(values) => {
            out.extend_from_slice(b" r");
            row(out, values);
        }
        AnswerRef::Pair(first, second) => {
            out.extend_from_slice(b" p");
            row(out, first);
            out.push(b';');
            if let Some(second) = second {
                row(out, second);
            }
        }
    }
    if let Some(hold) = hold {
        out.extend_from_slice(if hold.committed { b" c" } else { b" h" });
        for (i, v) in [hold.tokens, hold.until, hold.chain, hold.charged]
            .into_iter()
            .enumerate()
        {
            if i > 0 {
                out.push(b',');
            }
            number(out, v);
        }
    }
    out
}

/// When a remembered call is forgotten, in Unix milliseconds; None for a value that is
/// no remembered call (which then counts as no id at all).
pub fn forget_at(value: &[u8]) -> Option<i64> {
    let space = value.iter().position(|&b| b == b' ')?;
    crate::args::parse_integer(&value[..space])
}

/// The call remembered in `value`, whatever its time; None for anything else.
pub fn decode(value: &[u8]) -> Option<Record> {
    let mut parts = value.split(|&b| b == b' ');
    let forget_at = crate::args::parse_integer(parts.next()?)?;
    let reply = parts.next()?;
    let hold = match parts.next() {
        None => None,
        Some(hold) => {
            let (&state, numbers) = hold.split_first()?;
            let committed = match state {
                b'h' => false,
                b'c' => true,
                _ => return None,
            };
            let numbers: Option<Vec<i64>> = numbers
                .split(|&b| b == b',')
                .map(crate::args::parse_integer)
                .collect();
            match numbers?[..] {
                [tokens, until, chain, charged] => Some(Reserved {
                    tokens,
                    until,
                    chain,
                    charged,
                    committed,
                }),
                _ => return None,
            }
        }
    };
    if parts.next().is_some() {
        return None;
    }
    let row = |text: &[u8]| -> Option<Vec<Option<i64>>> {
        text.split(|&b| b == b',')
            .map(|v| match v.is_empty() {
                true => Some(None),
                false => crate::args::parse_integer(v).map(Some),
            })
            .collect()
    };
    let (&shape, body) = reply.split_first()?;
    let answer = match shape {
        b'i' => Answer::Integer(crate::args::parse_integer(body)?),
        b'r' => Answer::Row(row(body)?),
        b'p' => {
            let semicolon = body.iter().position(|&b| b == b';')?;
            let (first, second) = (&body[..semicolon], &body[semicolon + 1..]);
            let second = match second.is_empty() {
                true => None,
                false => Some(row(second)?),
            };
            Answer::Pair(row(first)?, second)
        }
        _ => return None,
    };
    Some(Record {
        forget_at,
        answer,
        hold,
    })
}

/// The call remembered in `value`, if it is still remembered at `now_millis`.
pub fn remembered(value: Option<&[u8]>, now_millis: i64) -> Option<Record> {
    decode(value?).filter(|record| record.forget_at > now_millis)
}

/// One remembered id as a look through a key's ids sees it: when it is forgotten (None:
/// not a remembered reply), and whether it is a reservation still needed
/// ([`Reserved::needed`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Standing {
    pub forget_at: Option<i64>,
    pub holding: bool,
}

/// How the id remembered as `value` stands at `now_millis`, a reservation ending after
/// `trusted_until` holding nothing ([`Reserved::holds_at`]).
pub fn standing(value: &[u8], now_millis: i64, trusted_until: i64) -> Standing {
    let forget_at = forget_at(value);
    // Only an ADMIT that reserved and is not committed has ` h…`: the others are not
    // decoded.
    let holding = value.windows(2).any(|pair| pair == b" h")
        && decode(value)
            .and_then(|record| record.hold)
            .is_some_and(|hold| hold.needed(now_millis, trusted_until));
    Standing { forget_at, holding }
}

/// Which of a key's remembered ids to forget, given each one's field and standing, as
/// one more is remembered: every one forgotten by `now_millis` or unreadable, and, while
/// `most` or more remain, the oldest down to three quarters of `most`, so that a key at
/// its cap is looked through once per quarter of it, not on every call. Those of
/// reservations still needed go last: forgotten, a reservation could no longer be
/// committed (its hold would count until it expires, and its commit would charge again
/// what its partials paid).
pub fn prune<T>(ids: Vec<(T, Standing)>, now_millis: i64, most: usize) -> Vec<T> {
    let (mut kept, forget): (Vec<_>, Vec<_>) = ids
        .into_iter()
        .partition(|(_, standing)| standing.forget_at.is_some_and(|at| at > now_millis));
    let mut forget: Vec<T> = forget.into_iter().map(|(field, _)| field).collect();
    if kept.len() >= most {
        kept.sort_by_key(|(_, standing)| (standing.holding, standing.forget_at));
        let excess = kept.len() - most * 3 / 4;
        forget.extend(kept.drain(..excess).map(|(field, _)| field));
    }
    forget
}

/// The most fields a key holds besides its ids (a bucket's two, a quota's three, a
/// window's counters and holds), for the cap: a key of more than `ID-MAX` and these
/// looks through its ids.
pub const OWN_FIELDS_MOST: usize = 16;

/// A key looks through its ids at least once in this many calls that remember one, on
/// average.
pub const LOOK_EVERY_MIN: u64 = 32;

/// A key of many fields looks through its ids once in its fields over this many calls:
/// a look reads every field, so a call reads this many of them on average.
pub const LOOK_SHARE: u64 = 4;

/// Whether remembering one more id in a key of `fields` fields looks through its ids
/// first: always at the cap; else about one call in `max(LOOK_EVERY_MIN, fields /
/// LOOK_SHARE)`, the calls picked by `pick` ([`pick`]). A look costs about as much as the
/// key has fields, so on average a call pays a constant for them (`LOOK_SHARE` fields
/// read), and reads nothing more than its own id to decide. A key called more often than
/// its ids are kept holds about a quarter more ids than it remembers; one called less
/// often (every id forgotten by its next call) about 34 on average, 200 at the most in
/// 99 keys of 100 (a look once in `fields` calls, the rule before, let such keys gather
/// about 200 on average: docs/replays.md).
pub fn looks_through(fields: usize, pick: u64, most: usize) -> bool {
    let every = LOOK_EVERY_MIN.max(fields as u64 / LOOK_SHARE);
    fields > most + OWN_FIELDS_MOST || pick.is_multiple_of(every)
}

/// A number that picks, about evenly and independently of how a caller makes its ids,
/// which calls look through their key's ids: mixed from the length of the id's field
/// name, its first and last eight bytes and the call's time (in any unit).
pub fn pick(id: &[u8], now: i64) -> u64 {
    let word = |bytes: &[u8]| bytes.iter().fold(0u64, |w, &b| w << 8 | u64::from(b));
    let head = word(&id[..id.len().min(8)]);
    let tail = word(&id[id.len().saturating_sub(8)..]);
    let mut x = head ^ tail.rotate_left(29) ^ (id.len() as u64).rotate_right(8) ^ now as u64;
    // The finaliser of MurmurHash3's 64-bit variant: every input bit moves every output bit.
    x = (x ^ x >> 33).wrapping_mul(0xff51_afd7_ed55_8ccd);
    x = (x ^ x >> 33).wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ x >> 33
}

/// A call's `ID request-id [KEEP seconds]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IdArg {
    /// The argument holding the request id.
    pub index: usize,
    /// How long the call asks its id remembered (the module keeps it at most
    /// ID-SECONDS); None: ID-SECONDS. A caller that replays only within seconds (a
    /// client library resending a call whose reply it lost) need not make its key
    /// remember the id for minutes.
    pub keep_seconds: Option<i64>,
}

/// `ID request-id [KEEP seconds]`, the word ID already read: the id 1 to MAX_ID_BYTES
/// bytes, KEEP 1 to a day.
pub fn parse_id<L: ArgList + ?Sized>(args: &mut Args<'_, L>) -> Result<IdArg, ArgError> {
    let (index, id) = args.string_and_bytes()?;
    if id.is_empty() || id.len() > MAX_ID_BYTES {
        return Err(ArgError::Text {
            name: "ID",
            rule: "1 to 128 bytes",
        });
    }
    let keep_seconds = match args.ahead(0) {
        Some(word) if word.eq_ignore_ascii_case(b"KEEP") => {
            args.string()?;
            Some(args.integer("KEEP", 1, crate::load::MAX_ID_SECONDS)?)
        }
        _ => None,
    };
    Ok(IdArg {
        index,
        keep_seconds,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn encoded(record: &Record) -> Vec<u8> {
        let mut out = Vec::new();
        encode(
            &mut out,
            record.forget_at,
            record.answer.as_ref(),
            record.hold,
        )
        .to_vec()
    }

    fn field(command: &str, id: &[u8]) -> Vec<u8> {
        field_name(&mut Vec::new(), command, id).to_vec()
    }

    #[test]
    fn field_names_keep_each_commands_ids_apart() {
        assert_eq!(field("take", b"req-1"), b"id:take:req-1");
        assert_ne!(field("take", b"x"), field("take2", b"x"));
        assert_eq!(field("record", b"a:b"), b"id:record:a:b");
        // The buffer is written afresh each time.
        let mut out = b"left over".to_vec();
        assert_eq!(field_name(&mut out, "take", b"r"), b"id:take:r");
    }

    fn record(answer: Answer, hold: Option<(i64, i64, bool)>) -> Record {
        let hold = hold.map(|(tokens, until, committed)| Reserved {
            tokens,
            until,
            chain: -7,
            charged: 9,
            committed,
        });
        Record {
            forget_at: 1_000,
            answer,
            hold,
        }
    }

    #[test]
    fn replies_round_trip_until_forgotten() {
        for (answer, hold) in [
            (Answer::Integer(7), None),
            (Answer::Integer(-1), None),
            (Answer::Row(vec![Some(1), Some(59), Some(0)]), None),
            (
                Answer::Row(vec![Some(1), None, Some(i64::MIN), Some(i64::MAX)]),
                None,
            ),
            (Answer::Pair(vec![Some(0), Some(0), Some(5)], None), None),
            (
                Answer::Pair(vec![Some(1), Some(19), Some(0)], Some(vec![Some(1), None])),
                None,
            ),
            (
                Answer::Row(vec![Some(1), Some(0)]),
                Some((300, 5_000, false)),
            ),
            (Answer::Row(vec![Some(1), Some(0)]), Some((0, 5_000, true))),
        ] {
            let record = record(answer, hold);
            let text = encoded(&record);
            assert_eq!(remembered(Some(&text), 999), Some(record.clone()));
            assert_eq!(
                remembered(Some(&text), 1_000),
                None,
                "forgotten at its time"
            );
            assert_eq!(forget_at(&text), Some(1_000));
            assert_eq!(decode(&text), Some(record));
        }
        assert_eq!(
            encoded(&record(
                Answer::Pair(vec![Some(0), Some(0), Some(5)], None),
                None
            )),
            b"1000 p0,0,5;"
        );
        assert_eq!(
            encoded(&record(
                Answer::Row(vec![Some(1), None]),
                Some((3, 4, false))
            )),
            b"1000 r1, h3,4,-7,9"
        );
        assert_eq!(
            encoded(&record(Answer::Row(vec![Some(1)]), Some((0, 4, true)))),
            b"1000 r1 c0,4,-7,9"
        );
    }

    #[test]
    fn chains_are_told_apart_by_keys_and_order() {
        let chain = |keys: &[&str]| chain_of(keys.iter().map(|k| k.as_bytes()));
        assert_eq!(chain(&["org", "key"]), chain(&["org", "key"]));
        assert_ne!(chain(&["org", "key"]), chain(&["key", "org"]));
        assert_ne!(chain(&["org", "key"]), chain(&["org"]));
        assert_ne!(chain(&["ab", "c"]), chain(&["a", "bc"]));
    }

    #[test]
    fn anything_else_is_no_remembered_reply() {
        for text in [
            &b""[..],
            b"5",
            b"x i1",
            b"9 ",
            b"9 q1",
            b"9 i",
            b"9 ix",
            b"9 r1,x",
            b"9 p1,2",
            b"9 p1;x",
            b"9 i1 x3,4",
            b"9 i1 h3",
            b"9 i1 h3,4",
            b"9 i1 h3,4,5",
            b"9 i1 h3,4,5,6,7",
            b"9 i1 h3,4,5,6 h",
            b"9 i1 x3,4,5,6",
            b"9 i1 c3,4,5",
        ] {
            assert_eq!(remembered(Some(text), 0), None, "{text:?}");
        }
        assert_eq!(remembered(None, 0), None);
        assert_eq!(forget_at(b"x i1"), None);
    }

    #[test]
    fn forgetting_drops_the_expired_then_the_oldest_beyond_the_cap() {
        let at = |forget_at: Option<i64>| Standing {
            forget_at,
            holding: false,
        };
        let ids = vec![
            ("a", at(Some(10))),
            ("b", at(Some(30))),
            ("c", at(None)),
            ("d", at(Some(20))),
        ];
        assert_eq!(prune(ids.clone(), 15, 8), vec!["a", "c"]);
        assert_eq!(prune(ids.clone(), 0, 8), vec!["c"]);
        // Three kept, at most 3: down to 3/4 of 3 = 2, oldest first.
        assert_eq!(prune(ids, 0, 3), vec!["c", "a"]);
        let none: Vec<(&str, Standing)> = vec![];
        assert!(prune(none, 0, 3).is_empty());
        let far = vec![("f", at(Some(i64::MAX)))];
        assert!(prune(far, 0, 3).is_empty());
    }

    #[test]
    fn open_reservations_are_forgotten_last() {
        let id = |forget_at: i64, holding: bool| Standing {
            forget_at: Some(forget_at),
            holding,
        };
        // The oldest holds a reservation: the next oldest go first.
        let ids = vec![
            ("stream", id(10, true)),
            ("a", id(20, false)),
            ("b", id(30, false)),
            ("c", id(40, false)),
        ];
        assert_eq!(prune(ids, 0, 4), vec!["a"]);
        // Only reservations: the oldest of them, the cap is the cap.
        let ids = vec![("x", id(20, true)), ("y", id(10, true))];
        assert_eq!(prune(ids, 0, 2), vec!["y"]);
    }

    #[test]
    fn a_record_stands_by_its_time_and_its_open_hold() {
        let record = |hold: Option<Reserved>| {
            encoded(&Record {
                forget_at: 500,
                answer: Answer::Row(vec![Some(1)]),
                hold,
            })
        };
        let hold = |tokens, until| Reserved {
            tokens,
            until,
            chain: 7,
            charged: 0,
            committed: false,
        };
        let standing = |value: &[u8]| standing(value, 100, 1_000);
        assert_eq!(
            standing(&record(None)),
            Standing {
                forget_at: Some(500),
                holding: false
            }
        );
        assert!(standing(&record(Some(hold(40, 200)))).holding);
        assert!(!standing(&record(Some(hold(40, 100)))).holding, "expired");
        assert!(!standing(&record(Some(hold(0, 200)))).holding, "all paid");
        assert!(
            standing(&record(Some(hold(40, 1_000)))).holding,
            "to the bound"
        );
        assert!(
            !standing(&record(Some(hold(40, 1_001)))).holding,
            "ending after the bound: no real hold"
        );
        // What its partials paid is needed by its commit, held or not.
        let paid = |tokens, until| Reserved {
            charged: 30,
            ..hold(tokens, until)
        };
        assert!(
            standing(&record(Some(paid(0, 200)))).holding,
            "paid by partials"
        );
        assert!(
            standing(&record(Some(paid(0, 100)))).holding,
            "expired, paid"
        );
        assert!(
            standing(&record(Some(paid(40, 5_000)))).holding,
            "beyond the bound, paid"
        );
        let committed = Reserved {
            committed: true,
            ..paid(40, 200)
        };
        assert!(!standing(&record(Some(committed))).holding, "committed");
        assert_eq!(standing(b"junk").forget_at, None);
    }

    #[test]
    fn a_charge_keeps_a_reservations_record_for_id_seconds_and_no_untrusted_end() {
        let hold = |until| Reserved {
            tokens: 40,
            until,
            chain: 7,
            charged: 0,
            committed: false,
        };
        let remembered = |forget_at| Record {
            forget_at,
            answer: Answer::Row(vec![Some(1)]),
            hold: Some(hold(forget_at)),
        };
        let after =
            |record: &Record, until| record.forget_at_after_charge(&hold(until), 1_000, 300, 2_000);
        assert_eq!(
            after(&remembered(1_100), 1_100),
            1_300,
            "ID-SECONDS from now"
        );
        assert_eq!(
            after(&remembered(1_900), 1_900),
            1_900,
            "the hold's end, later"
        );
        assert_eq!(after(&remembered(2_000), 2_000), 2_000, "to the bound");
        assert_eq!(
            after(&remembered(9_000), 9_000),
            1_300,
            "an end after the bound keeps nothing"
        );
        assert_eq!(after(&remembered(i64::MAX), 2_001), 1_300);
        let hold = Reserved {
            until: 1_500,
            ..hold(0)
        };
        assert!(hold.holds_at(1_000, 2_000));
        assert!(!hold.holds_at(1_500, 2_000), "ended");
        assert!(!hold.holds_at(1_000, 1_499), "beyond the bound");
        let committed = Reserved {
            committed: true,
            ..hold
        };
        assert!(!committed.holds_at(1_000, 2_000));
    }

    #[test]
    fn a_key_looks_through_its_ids_about_once_in_a_quarter_as_many_calls_as_it_has_fields() {
        let looks = |fields: usize, ids: &dyn Fn(u64) -> Vec<u8>| {
            (0..64_000u64)
                .filter(|&i| {
                    looks_through(
                        fields,
                        pick(&ids(i), 1_764_441_000_000_000 + i as i64 / 8),
                        1000,
                    )
                })
                .count()
        };
        // Ids made every way a gateway makes them: counters, a shared prefix, a shared
        // suffix, random; calls pipelined in the same microsecond.
        let counter = |i: u64| format!("r{i}").into_bytes();
        let suffixed = |i: u64| format!("{i:08}-0000-0000-0000-000000000000").into_bytes();
        let prefixed = |i: u64| format!("gateway-7-request-{i}").into_bytes();
        let random = |i: u64| pick(&i.to_le_bytes(), 0).to_le_bytes().to_vec();
        for ids in [
            &counter as &dyn Fn(u64) -> Vec<u8>,
            &suffixed,
            &prefixed,
            &random,
        ] {
            // One in 32 while a key has few fields (up to 128), one in a quarter of its
            // fields beyond.
            let small = looks(4, ids);
            assert!(
                (1_600..2_400).contains(&small),
                "{small} of 64,000 at 4 fields"
            );
            let edge = looks(128, ids);
            assert!(
                (1_600..2_400).contains(&edge),
                "{edge} of 64,000 at 128 fields"
            );
            let large = looks(400, ids);
            assert!(
                (530..770).contains(&large),
                "{large} of 64,000 at 400 fields"
            );
        }
        // At the cap, every call.
        assert!(looks_through(1000 + OWN_FIELDS_MOST + 1, 1, 1000));
        assert!(!looks_through(1000 + OWN_FIELDS_MOST, 1, 1000));
    }

    proptest! {
        #[test]
        fn any_stored_bytes_get_an_answer(bytes in proptest::collection::vec(any::<u8>(), 0..40), now in any::<i64>()) {
            let _ = remembered(Some(&bytes), now);
            let _ = forget_at(&bytes);
        }

        #[test]
        fn rows_round_trip(values in proptest::collection::vec(proptest::option::of(any::<i64>()), 1..6), at in 1i64..i64::MAX, hold in proptest::option::of((any::<i64>(), any::<i64>(), any::<i64>(), any::<i64>(), any::<bool>()))) {
            let hold = hold.map(|(tokens, until, chain, charged, committed)| Reserved { tokens, until, chain, charged, committed });
            let record = Record { forget_at: at, answer: Answer::Row(values), hold };
            prop_assert_eq!(remembered(Some(&encoded(&record)), at - 1), Some(record));
        }

        #[test]
        fn the_cap_holds(ats in proptest::collection::vec((proptest::option::of(0i64..100), any::<bool>()), 0..200), now in 0i64..100, most in 1usize..50) {
            let n = ats.len();
            let alive = |holding: Option<bool>| ats.iter().filter(|(at, h)| at.is_some_and(|at| at > now) && holding.is_none_or(|holding| *h == holding)).count();
            let (all, holding) = (alive(None), alive(Some(true)));
            let ids: Vec<(usize, Standing)> = ats.iter().map(|(forget_at, holding)| Standing { forget_at: *forget_at, holding: *holding }).enumerate().collect();
            let forget = prune(ids, now, most);
            let kept = n - forget.len();
            prop_assert!(kept <= all);
            prop_assert!(kept < most, "room for the new one within the cap");
            if all < most {
                prop_assert_eq!(kept, all, "nothing alive is forgotten below the cap");
            }
            let holding_forgotten = forget.iter().filter(|i| ats[**i].1 && ats[**i].0.is_some_and(|at| at > now)).count();
            if holding_forgotten > 0 {
                prop_assert_eq!(kept, holding - holding_forgotten, "open reservations go only when nothing else is left");
            }
        }
    }
}
