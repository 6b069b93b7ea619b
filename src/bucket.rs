//! The token-bucket family: QAG.TAKE, QAG.TAKE2 and QAG.PEEK, the native twins of
//! `lua/token_bucket.lua` on the same hash (`tokens`, `ts`), and QAG.REFUND, the twin of
//! `lua/token_refund.lua`. With `WAIT ms`, a take that would fit within `ms` is charged
//! when it arrives and answered when its tokens exist (wait.rs holds it).

use qag_core::replay::IdArg;
use std::ffi::CStr;

use qag_core::args::ArgList;
use qag_core::bucket::{self, Limit, State, Take as Outcome, Verdict, Waiting};
use qag_core::number::{format_number, NumberBuffer};

use crate::command::{Arg, Command, KeyLayout, RawArgs, Reply, Row, ID_ARG, WAIT_ARG};
use crate::key::{Access, FieldName, Key, OwnedString, ValueType};
use crate::replay::{self, Remembered, RequestId};
use crate::server::RawString;
use crate::server::{CommandError, Ctx};
use crate::stats::{CallCounters, ALLOWED, REFUSED, REFUSED_KEY, WAITS};
use crate::wait::{self, Held, Request, Serve};

static TOKENS: FieldName = FieldName::new("tokens");
static TS: FieldName = FieldName::new("ts");
/// An unused place in a list of fields to write.
const NO_FIELD: (RawString, RawString) = (std::ptr::null_mut(), std::ptr::null_mut());

/// Makes the field names; called once when the module loads.
pub fn init() {
    TOKENS.create();
    TS.create();
}

/// A bucket opened for a call: its key and its limit.
struct Bucket<'a> {
    key: Key<'a>,
    limit: Limit,
}

impl<'a> Bucket<'a> {
    fn open(
        ctx: &'a Ctx,
        raw_args: &RawArgs,
        key: usize,
        limit: Limit,
        access: Access,
    ) -> Result<Self, CommandError> {
        Self::open_named(ctx, raw_args.string(key), limit, access)
    }

    fn open_named(
        ctx: &'a Ctx,
        name: RawString,
        limit: Limit,
        access: Access,
    ) -> Result<Self, CommandError> {
        Ok(Bucket {
            key: Key::open(ctx, name, access, ValueType::Hash)?,
            limit,
        })
    }

    /// The stored fields a call at `now` reads: None (a full bucket) when either is
    /// missing or unreadable, or when `ts` is more than a period ahead (`bucket::trusted`).
    fn stored(&self, now: f64) -> Option<State> {
        let [tokens, ts] = self.key.hash_get([TOKENS.raw(), TS.raw()]);
        self.state_of(tokens, ts, now)
    }

    fn state_of(
        &self,
        tokens: Option<OwnedString>,
        ts: Option<OwnedString>,
        now: f64,
    ) -> Option<State> {
        let stored = bucket::parse_state(
            tokens.as_ref().map(OwnedString::bytes),
            ts.as_ref().map(OwnedString::bytes),
        );
        bucket::trusted(stored, self.limit, now)
    }

    /// What taking `cost` would do now, from the stored fields; writes nothing.
    fn take(&self, cost: i64, now_micros: i64) -> Outcome {
        let now = bucket::seconds_from_micros(now_micros);
        bucket::take(self.limit, cost, self.stored(now), now)
    }

    /// The stored state at `now_micros` and, for a call with a request id (its command
    /// and the id's argument), the id: read in one call.
    fn read(
        &self,
        ctx: &Ctx,
        args: &RawArgs,
        id: Option<(&str, IdArg)>,
        now_micros: i64,
    ) -> (Option<State>, Option<RequestId>) {
        let now = bucket::seconds_from_micros(now_micros);
        let Some((command, id)) = id else {
            return (self.stored(now), None);
        };
        let field = RequestId::field(ctx, command, args, id.index);
        let [tokens, ts, value] = self.key.hash_get([TOKENS.raw(), TS.raw(), field.raw]);
        let id = RequestId::found(field, value, id, now_micros / 1000);
        (self.state_of(tokens, ts, now), Some(id))
    }

    /// Writes a state and the expiry back; they replicate as HSET and, when the expiry
    /// moves (`bucket::expiry_after_call`), PEXPIREAT: the effects, never the command,
    /// since the result depends on the primary's clock. `remembered`: the request id
    /// this call remembers, written in the same HSET.
    fn write(
        &mut self,
        ctx: &Ctx,
        state: &State,
        now_micros: i64,
        remembered: Option<&Remembered>,
    ) {
        let mut text = NumberBuffer::new();
        let tokens = OwnedString::new(ctx, format_number(&mut text, state.tokens).as_bytes());
        let ts = OwnedString::new(ctx, format_number(&mut text, state.ts).as_bytes());
        // Its own two fields and what the call remembers: one HSET, on the stack.
        let mut fields = [(TOKENS.raw(), tokens.raw), (TS.raw(), ts.raw), NO_FIELD];
        let mut written = 2;
        if let Some(r) = remembered {
            fields[written] = r.field();
            written += 1;
        }
        self.key.set_fields(&fields[..written]);
        let (state, limit) = (*state, self.limit);
        let own_id = remembered.map_or(0, |r| r.keep_until);
        self.key.expire_given(|current, key| {
            let full = bucket::expiry_after_call(current, now_micros, &state, limit);
            // A hash that remembers request ids (fields beyond `tokens` and `ts`) keeps
            // its expiry for them, as long as it is not full earlier: only an expiry
            // about to move earlier needs the look at its fields.
            match full < current && (own_id > 0 || key.len() > 2) {
                true => full
                    .max(current.min(replay::keep_until(now_micros / 1000)))
                    .max(own_id),
                false => full.max(own_id),
            }
        });
    }

    /// Writes only what the call remembers, for a call that changes no bucket.
    fn remember_only(&mut self, remembered: Option<&Remembered>) {
        if let Some(r) = remembered {
            self.key.set_fields(&[r.field()]);
            self.key
                .expire_given(|current, _| current.max(r.keep_until));
        }
    }
}

/// `key count period [COST n]`: PEEK's arguments, and TAKE's before its `[ID request-id]`.
const PEEK_ARGS: &[Arg] = &[
    Arg::key(c"key", 0),
    Arg::integer(c"count"),
    Arg::double(c"period"),
    Arg::integer(c"cost").token(c"COST").optional(),
];

const TAKE_ARGS: &[Arg] = &[
    PEEK_ARGS[0],
    PEEK_ARGS[1],
    PEEK_ARGS[2],
    PEEK_ARGS[3],
    ID_ARG,
    WAIT_ARG,
];

static TAKE: CallCounters = CallCounters::new();
static TAKE_PAIR: CallCounters = CallCounters::new();
static PEEK: CallCounters = CallCounters::new();

/// QAG.TAKE key count period [COST n] [ID request-id] [WAIT ms]
pub struct Take;

impl Command for Take {
    const NAME: &'static CStr = c"qag.take";
    const FLAGS: &'static CStr = c"write deny-oom fast";
    const ARITY: i32 = -4;
    const KEYS: KeyLayout = KeyLayout::Single;
    const WRITES: bool = true;
    const SUMMARY: &'static CStr =
        c"Takes tokens from a token bucket; replies [allowed, tokens left, retry after seconds]";
    const COMPLEXITY: &'static CStr = c"O(1)";
    const ARGS: &'static [Arg] = TAKE_ARGS;
    const COUNTERS: &'static CallCounters = &TAKE;
    const OUTCOMES: &'static [&'static str] = &["allowed", "refused"];

    fn run(ctx: &Ctx, args: &RawArgs) -> Result<Reply, CommandError> {
        let take = bucket::parse_take(args, true)?;
        let mut bucket = Bucket::open(ctx, args, take.key, take.limit, Access::ReadWrite)?;
        let now = ctx.now_micros();
        let (stored, id) = bucket.read(ctx, args, take.id.map(|index| ("take", index)), now);
        if let Some(reply) = id.as_ref().and_then(RequestId::replay) {
            return Ok(replayed(ctx, reply, now, args.get(take.key), id.as_ref()));
        }
        let seconds = bucket::seconds_from_micros(now);
        let Some(wait_ms) = take.wait else {
            let outcome = bucket::take(take.limit, take.cost, stored, seconds);
            let reply = || Reply::Array(outcome.verdict.as_reply().into());
            // Built where it is needed: a reply is a hundred bytes to copy.
            let remembered = id.map(|id| id.remember(ctx, &mut bucket.key, &reply(), now / 1000));
            bucket.write(ctx, &outcome.state, now, remembered.as_ref());
            TAKE.allowed_or_refused(outcome.verdict.allowed);
            return Ok(reply());
        };
        let waiting = bucket::take_waiting(take.limit, take.cost, stored, seconds, wait_ms);
        // Room is asked only of a call that must wait.
        let later = match waiting {
            Waiting::Later { state, wait_micros } => {
                wait::room(ctx).ok().map(|()| (state, wait_micros))
            }
            Waiting::Now(_) => None,
        };
        let (state, wait_micros) = match later {
            Some(later) => later,
            // Answered now, as without WAIT: a fourth element, nothing waited.
            None => {
                let outcome = bucket::take(take.limit, take.cost, stored, seconds);
                let reply = Reply::Array(waited_row(outcome.verdict, 0));
                count_refusal(&waiting, &outcome.verdict);
                let remembered = id.map(|id| id.remember(ctx, &mut bucket.key, &reply, now / 1000));
                bucket.write(ctx, &outcome.state, now, remembered.as_ref());
                TAKE.allowed_or_refused(outcome.verdict.allowed);
                return Ok(reply);
            }
        };
        let due = now + wait_micros;
        let served = Verdict {
            allowed: true,
            tokens_left: 0,
            retry_after: 0,
        };
        let id_field = id.as_ref().map(RequestId::field_bytes);
        let remembered = id.map(|id| {
            let record = Reply::Array(due_row(served, wait_micros, due));
            id.remember_until(ctx, &mut bucket.key, &record, now / 1000, due / 1000)
        });
        bucket.write(ctx, &state, now, remembered.as_ref());
        TAKE.allowed_or_refused(true);
        let held = HeldTake {
            keys: vec![args.get(take.key).to_vec()],
            limits: vec![take.limit],
            cost: take.cost,
            due: vec![due],
            answer: WaitedAnswer::One(served),
            id_field: id_field.clone(),
            charged: true,
        };
        let request = id_field.map(Request::Charged);
        Ok(wait::hold(ctx, Box::new(held), due, true, request))
    }
}

/// A verdict with how long the call waited, the reply of a call with WAIT.
fn waited_row(verdict: Verdict, waited_ms: i64) -> Row {
    let [allowed, left, retry] = verdict.as_reply();
    Row::from([allowed, left, retry, waited_ms])
}

/// What a call that waits remembers under its request id: its answer, how long it was
/// to wait (ms), and when its tokens exist (Unix ms), so that a replay waits only what
/// is left of it.
fn due_row(verdict: Verdict, wait_micros: i64, due_micros: i64) -> Row {
    let [allowed, left, retry] = verdict.as_reply();
    let wait_ms = qag_core::wait::millis_up(wait_micros);
    Row::from([
        allowed,
        left,
        retry,
        wait_ms,
        qag_core::wait::millis_up(due_micros),
    ])
}

/// A call with WAIT answered at once: refused because its tokens would come too late,
/// counted as such.
fn count_refusal(waiting: &Waiting, verdict: &Verdict) {
    if matches!(waiting, Waiting::Now(_)) && !verdict.allowed && verdict.retry_after >= 0 {
        WAITS.refused();
    }
}

/// A take's (or a pair's) remembered reply, answered again: one that waited is answered
/// at its time (held until then, charged nothing: it shares its first call's charge,
/// given back only if neither is answered), without the time it was due.
fn replayed(ctx: &Ctx, reply: Reply, now: i64, key: &[u8], id: Option<&RequestId>) -> Reply {
    let due_of = |row: &Row| row.values().get(4).copied().flatten();
    let (due, answer) = match reply {
        Reply::Array(row) => match due_of(&row) {
            Some(due) => (due, WaitedAnswer::One(verdict_of(&row))),
            None => return reply,
        },
        Reply::Pair(client, Some(key_row)) => match due_of(&client) {
            Some(due) => (
                due,
                WaitedAnswer::Pair(verdict_of(&client), Some(verdict_of(&key_row))),
            ),
            None => return reply,
        },
        _ => return reply,
    };
    let due = due.saturating_mul(1000);
    let planned = |row: &Row| row.values().get(3).copied().flatten().unwrap_or(0);
    let waited_then = match reply {
        Reply::Array(row) | Reply::Pair(row, _) => planned(&row),
        _ => 0,
    };
    let field = id.map(RequestId::field_bytes);
    if due <= now || wait::room(ctx).is_err() {
        if let (Some(field), true) = (field, answer.allowed()) {
            wait::replay_answered(ctx, key, field);
        }
        return answer.reply(waited_then);
    }
    let held = HeldTake {
        keys: vec![key.to_vec()],
        limits: Vec::new(),
        cost: 0,
        due: vec![due],
        answer,
        id_field: None,
        charged: false,
    };
    wait::hold(ctx, Box::new(held), due, true, field.map(Request::Replay))
}

fn verdict_of(row: &Row) -> Verdict {
    let value = |index: usize| row.values().get(index).copied().flatten().unwrap_or(0);
    Verdict {
        allowed: value(0) == 1,
        tokens_left: value(1),
        retry_after: value(2),
    }
}

/// What a waiting take answers when served: TAKE's verdict, or TAKE2's two.
#[derive(Clone, Copy)]
enum WaitedAnswer {
    One(Verdict),
    Pair(Verdict, Option<Verdict>),
}

impl WaitedAnswer {
    fn allowed(&self) -> bool {
        match *self {
            WaitedAnswer::One(verdict) => verdict.allowed,
            WaitedAnswer::Pair(client, key) => client.allowed && key.is_some_and(|k| k.allowed),
        }
    }

    fn reply(&self, waited_ms: i64) -> Reply {
        match *self {
            WaitedAnswer::One(verdict) => Reply::Array(waited_row(verdict, waited_ms)),
            WaitedAnswer::Pair(client, key) => Reply::Pair(
                waited_row(client, waited_ms),
                key.map(|key| waited_row(key, waited_ms)),
            ),
        }
    }
}

/// A take (or a pair) charged when it arrived, answered when the tokens of each of its
/// buckets exist.
struct HeldTake {
    keys: Vec<Vec<u8>>,
    limits: Vec<Limit>,
    cost: i64,
    /// When each bucket's tokens exist, Unix microseconds: it is served at the latest.
    due: Vec<i64>,
    answer: WaitedAnswer,
    /// The request id's field in the first key, forgotten with a give-back (the
    /// request was charged nothing, so may be sent again).
    id_field: Option<Vec<u8>>,
    /// False for a replay, which holds what its first call was charged.
    charged: bool,
}

impl HeldTake {
    fn due(&self) -> i64 {
        self.due.iter().copied().max().unwrap_or(0)
    }
}

impl Held for HeldTake {
    fn keys(&self) -> &[Vec<u8>] {
        &self.keys
    }

    fn serve(&mut self, _ctx: &Ctx, _now_micros: i64, waited_ms: i64) -> Serve {
        Serve::Now(self.answer.reply(waited_ms))
    }

    fn refusal(&self, _ctx: &Ctx, now_micros: i64, waited_ms: i64) -> Reply {
        let retry = (self.due() - now_micros).max(0) as f64 / 1e6;
        let refused = Verdict {
            allowed: false,
            tokens_left: 0,
            retry_after: retry.ceil() as i64,
        };
        match self.answer {
            WaitedAnswer::One(_) => Reply::Array(waited_row(refused, waited_ms)),
            WaitedAnswer::Pair(..) => Reply::Pair(waited_row(refused, waited_ms), None),
        }
    }

    fn give_back(&mut self, ctx: &Ctx, now_micros: i64) -> Vec<(usize, f64)> {
        let mut given = Vec::new();
        if !self.charged {
            return given;
        }
        let now = bucket::seconds_from_micros(now_micros);
        for (index, (name, limit)) in self.keys.iter().zip(&self.limits).enumerate() {
            let name = OwnedString::new(ctx, name);
            let Ok(mut bucket) = Bucket::open_named(ctx, name.raw, *limit, Access::ReadWrite)
            else {
                continue;
            };
            let back = bucket::refund(*limit, self.cost, bucket.stored(now), now);
            if let Some(state) = back.state {
                bucket.write(ctx, &state, now_micros, None);
            }
            if let (0, Some(field)) = (index, &self.id_field) {
                bucket
                    .key
                    .delete_fields(&[OwnedString::new(ctx, field).raw]);
            }
            given.push((index, back.given));
        }
        given
    }

    fn sooner(&mut self, key: usize, tokens: f64) -> Option<i64> {
        let (limit, due) = (self.limits.get(key)?, self.due.get_mut(key)?);
        *due -= bucket::refill_micros(*limit, tokens);
        Some(self.due())
    }
}

/// QAG.TAKE2 ckey ccount cperiod kkey kcount kperiod [COST n] [ID request-id] [WAIT ms]
pub struct TakePair;

impl Command for TakePair {
    const NAME: &'static CStr = c"qag.take2";
    const FLAGS: &'static CStr = c"write deny-oom fast";
    const ARITY: i32 = -7;
    const KEYS: KeyLayout = KeyLayout::FirstAndFourth;
    const WRITES: bool = true;
    const SUMMARY: &'static CStr =
        c"Takes from a client bucket, then, only if it allowed, from a key bucket; replies both TAKE replies";
    const COMPLEXITY: &'static CStr = c"O(1)";
    const ARGS: &'static [Arg] = &[
        Arg::key(c"ckey", 0),
        Arg::integer(c"ccount"),
        Arg::double(c"cperiod"),
        Arg::key(c"kkey", 1),
        Arg::integer(c"kcount"),
        Arg::double(c"kperiod"),
        Arg::integer(c"cost").token(c"COST").optional(),
        ID_ARG,
        WAIT_ARG,
    ];
    const COUNTERS: &'static CallCounters = &TAKE_PAIR;
    const OUTCOMES: &'static [&'static str] = &["allowed", "refused_client", "refused_key"];

    fn run(ctx: &Ctx, args: &RawArgs) -> Result<Reply, CommandError> {
        Self::take_both(ctx, args)
    }
}

/// TAKE2's reply and its outcome in INFO; with WAIT (`waited`), each row with how long
/// the call waited.
fn pair_reply(client: Verdict, key: Option<Verdict>, waited: Option<i64>) -> Reply {
    TAKE_PAIR.decided(match key {
        None => REFUSED,
        Some(key) if !key.allowed => REFUSED_KEY,
        Some(_) => ALLOWED,
    });
    match waited {
        Some(waited) => WaitedAnswer::Pair(client, key).reply(waited),
        None => Reply::Pair(
            client.as_reply().into(),
            key.map(|key| key.as_reply().into()),
        ),
    }
}

/// A bucket's take within a wait: its state once charged and how long it waits (0:
/// allowed now); None when it refuses.
fn within_wait(waiting: Waiting) -> Option<(State, i64)> {
    match waiting {
        Waiting::Now(outcome) if outcome.verdict.allowed => Some((outcome.state, 0)),
        Waiting::Later { state, wait_micros } => Some((state, wait_micros)),
        Waiting::Now(_) => None,
    }
}

impl TakePair {
    /// TAKE2 … WAIT on two keys: Ok(the held call) when both buckets' tokens exist
    /// within the wait and one is not there yet (both charged now); else Err(the id
    /// back), and the call goes on as without WAIT.
    #[allow(clippy::too_many_arguments)]
    fn wait_both(
        ctx: &Ctx,
        args: &RawArgs,
        pair: &bucket::TakePairArgs,
        client: &mut Bucket,
        stored: Option<State>,
        id: Option<RequestId>,
        now: i64,
        wait_ms: i64,
    ) -> Result<Result<Reply, Option<RequestId>>, CommandError> {
        let seconds = bucket::seconds_from_micros(now);
        let cost = pair.client.cost;
        let client_waiting =
            bucket::take_waiting(pair.client.limit, cost, stored, seconds, wait_ms);
        if within_wait(client_waiting).is_none() {
            // Refused by the client bucket: answered as without WAIT, the key bucket
            // only type-checked, never opened for writing.
            if let Waiting::Now(outcome) = client_waiting {
                count_refusal(&client_waiting, &outcome.verdict);
            }
            return Ok(Err(id));
        }
        // Both keys open and of the right type before either is written.
        let mut key = Bucket::open(ctx, args, pair.key.key, pair.key.limit, Access::ReadWrite)?;
        let key_waiting =
            bucket::take_waiting(pair.key.limit, cost, key.stored(seconds), seconds, wait_ms);
        let (Some((client_state, client_wait)), Some((key_state, key_wait))) =
            (within_wait(client_waiting), within_wait(key_waiting))
        else {
            for waiting in [client_waiting, key_waiting] {
                if let Waiting::Now(outcome) = waiting {
                    count_refusal(&waiting, &outcome.verdict);
                }
            }
            return Ok(Err(id));
        };
        if (client_wait == 0 && key_wait == 0) || wait::room(ctx).is_err() {
            return Ok(Err(id));
        }
        let due = now + client_wait.max(key_wait);
        let left = |state: &State| (state.tokens.floor() as i64).max(0);
        let verdict = |left| Verdict {
            allowed: true,
            tokens_left: left,
            retry_after: 0,
        };
        let (client_verdict, key_verdict) =
            (verdict(left(&client_state)), verdict(left(&key_state)));
        let id_field = id.as_ref().map(RequestId::field_bytes);
        let remembered = id.map(|id| {
            let wait_micros = due - now;
            let record = Reply::Pair(
                due_row(client_verdict, wait_micros, due),
                Some(due_row(key_verdict, wait_micros, due)),
            );
            id.remember_until(ctx, &mut client.key, &record, now / 1000, due / 1000)
        });
        client.write(ctx, &client_state, now, remembered.as_ref());
        key.write(ctx, &key_state, now, None);
        TAKE_PAIR.decided(ALLOWED);
        let held = HeldTake {
            keys: vec![
                args.get(pair.client.key).to_vec(),
                args.get(pair.key.key).to_vec(),
            ],
            limits: vec![pair.client.limit, pair.key.limit],
            cost,
            due: vec![now + client_wait, now + key_wait],
            answer: WaitedAnswer::Pair(client_verdict, Some(key_verdict)),
            id_field: id_field.clone(),
            charged: true,
        };
        let request = id_field.map(Request::Charged);
        Ok(Ok(wait::hold(ctx, Box::new(held), due, true, request)))
    }

    /// Takes from the client bucket, then, when it allowed, from the key bucket. A
    /// request id lives in the client bucket's key, which every call writes.
    fn take_both(ctx: &Ctx, args: &RawArgs) -> Result<Reply, CommandError> {
        let pair = bucket::parse_take_pair(args)?;
        let now = ctx.now_micros();
        let cost = pair.client.cost;
        let mut client = Bucket::open(
            ctx,
            args,
            pair.client.key,
            pair.client.limit,
            Access::ReadWrite,
        )?;
        let id = pair.client.id.map(|index| ("take2", index));
        let (stored, id) = client.read(ctx, args, id, now);
        if let Some(reply) = id.as_ref().and_then(RequestId::replay) {
            return Ok(replayed(
                ctx,
                reply,
                now,
                args.get(pair.client.key),
                id.as_ref(),
            ));
        }
        let seconds = bucket::seconds_from_micros(now);
        let same_key = args.get(pair.client.key) == args.get(pair.key.key);
        let waited = pair.client.wait.map(|_| 0);
        // With WAIT on two buckets: both charged now and answered when the later's
        // tokens exist, or, when either cannot be within the wait, as without WAIT.
        let id = match (pair.client.wait, same_key) {
            (Some(wait_ms), false) => {
                match Self::wait_both(ctx, args, &pair, &mut client, stored, id, now, wait_ms)? {
                    Ok(reply) => return Ok(reply),
                    Err(id) => id,
                }
            }
            _ => id,
        };
        let client_outcome = bucket::take(pair.client.limit, cost, stored, seconds);
        let client_verdict = client_outcome.verdict;

        if same_key {
            // One key as both buckets: the script run twice on it, through one handle.
            client.write(ctx, &client_outcome.state, now, None);
            let mut again = Bucket {
                limit: pair.key.limit,
                ..client
            };
            let key_outcome = client_verdict.allowed.then(|| again.take(cost, now));
            let reply = pair_reply(client_verdict, key_outcome.map(|o| o.verdict), waited);
            let remembered = id.map(|id| id.remember(ctx, &mut again.key, &reply, now / 1000));
            match key_outcome {
                Some(outcome) => again.write(ctx, &outcome.state, now, remembered.as_ref()),
                None => again.remember_only(remembered.as_ref()),
            }
            return Ok(reply);
        }

        if !client_verdict.allowed {
            // The key bucket is not counted, only type-checked: no write, no touch.
            Bucket::open(
                ctx,
                args,
                pair.key.key,
                pair.key.limit,
                Access::ReadUntouched,
            )?;
            let reply = pair_reply(client_verdict, None, waited);
            let remembered = id.map(|id| id.remember(ctx, &mut client.key, &reply, now / 1000));
            client.write(ctx, &client_outcome.state, now, remembered.as_ref());
            return Ok(reply);
        }
        // Both keys are open and of the right type before either is written.
        let mut key = Bucket::open(ctx, args, pair.key.key, pair.key.limit, Access::ReadWrite)?;
        let key_outcome = key.take(cost, now);
        let reply = pair_reply(client_verdict, Some(key_outcome.verdict), waited);
        let remembered = id.map(|id| id.remember(ctx, &mut client.key, &reply, now / 1000));
        client.write(ctx, &client_outcome.state, now, remembered.as_ref());
        key.write(ctx, &key_outcome.state, now, None);
        Ok(reply)
    }
}

/// QAG.PEEK key count period [COST n]: what TAKE would answer, writing nothing.
pub struct Peek;

impl Command for Peek {
    const NAME: &'static CStr = c"qag.peek";
    const FLAGS: &'static CStr = c"readonly fast";
    const ARITY: i32 = -4;
    const KEYS: KeyLayout = KeyLayout::Single;
    const WRITES: bool = false;
    const SUMMARY: &'static CStr =
        c"Replies what QAG.TAKE would reply now, without changing the bucket";
    const COMPLEXITY: &'static CStr = c"O(1)";
    const ARGS: &'static [Arg] = PEEK_ARGS;
    const COUNTERS: &'static CallCounters = &PEEK;

    fn run(ctx: &Ctx, args: &RawArgs) -> Result<Reply, CommandError> {
        let peek = bucket::parse_take(args, false)?;
        let bucket = Bucket::open(ctx, args, peek.key, peek.limit, Access::Read)?;
        let outcome = bucket.take(peek.cost, ctx.now_micros());
        Ok(Reply::Array(outcome.verdict.as_reply().into()))
    }
}

static REFUND: CallCounters = CallCounters::new();

/// QAG.REFUND key count period n [ID request-id]: gives tokens back to a bucket.
pub struct Refund;

impl Command for Refund {
    const NAME: &'static CStr = c"qag.refund";
    const FLAGS: &'static CStr = c"write deny-oom fast";
    const ARITY: i32 = -5;
    const KEYS: KeyLayout = KeyLayout::Single;
    const WRITES: bool = true;
    const SINCE: &'static CStr = c"0.3.0";
    const SUMMARY: &'static CStr =
        c"Gives n tokens back to a token bucket, refilled to now first and never above its count; replies the tokens left";
    const COMPLEXITY: &'static CStr = c"O(1)";
    const ARGS: &'static [Arg] = &[
        Arg::key(c"key", 0),
        Arg::integer(c"count"),
        Arg::double(c"period"),
        Arg::integer(c"n"),
        ID_ARG,
    ];
    const COUNTERS: &'static CallCounters = &REFUND;

    fn run(ctx: &Ctx, args: &RawArgs) -> Result<Reply, CommandError> {
        let refund = bucket::parse_refund(args)?;
        let mut bucket = Bucket::open(ctx, args, refund.key, refund.limit, Access::ReadWrite)?;
        let now = ctx.now_micros();
        let id = refund.id.map(|index| ("refund", index));
        let (stored, id) = bucket.read(ctx, args, id, now);
        if let Some(reply) = id.as_ref().and_then(RequestId::replay) {
            return Ok(reply);
        }
        let seconds = bucket::seconds_from_micros(now);
        let outcome = bucket::refund(refund.limit, refund.amount, stored, seconds);
        if wait::has_waiters(ctx, args.get(refund.key)) {
            wait::given_back_to(ctx, args.get(refund.key), outcome.given);
        }
        let reply = Reply::Integer(outcome.tokens_left);
        let remembered = id.map(|id| id.remember(ctx, &mut bucket.key, &reply, now / 1000));
        match &outcome.state {
            Some(state) => bucket.write(ctx, state, now, remembered.as_ref()),
            // A missing bucket is full: nothing to write but the id, kept its time.
            None => bucket.remember_only(remembered.as_ref()),
        }
        Ok(reply)
    }
}
