//! The token-bucket family: QAG.TAKE, QAG.TAKE2 and QAG.PEEK, the native twins of
//! `lua/token_bucket.lua` on the same hash (`tokens`, `ts`), and QAG.REFUND, the twin of
//! `lua/token_refund.lua`.

use qag_core::replay::IdArg;
use std::ffi::CStr;

use qag_core::args::ArgList;
use qag_core::bucket::{self, Limit, State, Take as Outcome, Verdict};
use qag_core::number::{format_number, NumberBuffer};

use crate::command::{Arg, Command, KeyLayout, RawArgs, Reply, ID_ARG};
use crate::key::{Access, FieldName, Key, OwnedString, ValueType};
use crate::replay::{self, Remembered, RequestId};
use crate::server::RawString;
use crate::server::{CommandError, Ctx};
use crate::stats::{CallCounters, ALLOWED, REFUSED, REFUSED_KEY};

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
        Ok(Bucket {
            key: Key::open(ctx, raw_args.string(key), access, ValueType::Hash)?,
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
        let (ts, period) = (state.ts, self.limit.period);
        let own_id = remembered.map_or(0, |r| r.keep_until);
        self.key.expire_given(|current, key| {
            let full = bucket::expiry_after_call(current, now_micros, ts, period);
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
];

static TAKE: CallCounters = CallCounters::new();
static TAKE_PAIR: CallCounters = CallCounters::new();
static PEEK: CallCounters = CallCounters::new();

/// QAG.TAKE key count period [COST n] [ID request-id]
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
            return Ok(reply);
        }
        let seconds = bucket::seconds_from_micros(now);
        let outcome = bucket::take(take.limit, take.cost, stored, seconds);
        let reply = || Reply::Array(outcome.verdict.as_reply().into());
        // Built where it is needed: a reply is a hundred bytes to copy.
        let remembered = id.map(|id| id.remember(ctx, &mut bucket.key, &reply(), now / 1000));
        bucket.write(ctx, &outcome.state, now, remembered.as_ref());
        TAKE.allowed_or_refused(outcome.verdict.allowed);
        Ok(reply())
    }
}

/// QAG.TAKE2 ckey ccount cperiod kkey kcount kperiod [COST n] [ID request-id]
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
    ];
    const COUNTERS: &'static CallCounters = &TAKE_PAIR;
    const OUTCOMES: &'static [&'static str] = &["allowed", "refused_client", "refused_key"];

    fn run(ctx: &Ctx, args: &RawArgs) -> Result<Reply, CommandError> {
        Self::take_both(ctx, args)
    }
}

/// TAKE2's reply and its outcome in INFO.
fn pair_reply(client: Verdict, key: Option<Verdict>) -> Reply {
    TAKE_PAIR.decided(match key {
        None => REFUSED,
        Some(key) if !key.allowed => REFUSED_KEY,
        Some(_) => ALLOWED,
    });
    Reply::Pair(
        client.as_reply().into(),
        key.map(|key| key.as_reply().into()),
    )
}

impl TakePair {
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
            return Ok(reply);
        }
        let seconds = bucket::seconds_from_micros(now);
        let client_outcome = bucket::take(pair.client.limit, cost, stored, seconds);
        let client_verdict = client_outcome.verdict;

        if args.get(pair.client.key) == args.get(pair.key.key) {
            // One key as both buckets: the script run twice on it, through one handle.
            client.write(ctx, &client_outcome.state, now, None);
            let mut again = Bucket {
                limit: pair.key.limit,
                ..client
            };
            let key_outcome = client_verdict.allowed.then(|| again.take(cost, now));
            let reply = pair_reply(client_verdict, key_outcome.map(|o| o.verdict));
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
            let reply = pair_reply(client_verdict, None);
            let remembered = id.map(|id| id.remember(ctx, &mut client.key, &reply, now / 1000));
            client.write(ctx, &client_outcome.state, now, remembered.as_ref());
            return Ok(reply);
        }
        // Both keys are open and of the right type before either is written.
        let mut key = Bucket::open(ctx, args, pair.key.key, pair.key.limit, Access::ReadWrite)?;
        let key_outcome = key.take(cost, now);
        let reply = pair_reply(client_verdict, Some(key_outcome.verdict));
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
