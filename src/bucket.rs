//! The token-bucket family: QAG.TAKE, QAG.TAKE2 and QAG.PEEK, the native twins of
//! `lua/token_bucket.lua` on the same hash (`tokens`, `ts`), and QAG.REFUND, the twin of
//! `lua/token_refund.lua`.

use std::ffi::CStr;

use qag_core::args::ArgList;
use qag_core::bucket::{self, Limit, State, Take as Outcome, Verdict};
use qag_core::number::format_number;

use crate::command::{Arg, Command, CommandError, Ctx, KeyLayout, RawArgs, Reply};
use crate::key::{Access, FieldName, Key, OwnedString, ValueType};
use crate::stats::{CallCounters, ALLOWED, REFUSED, REFUSED_KEY};

static TOKENS: FieldName = FieldName::new("tokens");
static TS: FieldName = FieldName::new("ts");

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

    /// Writes a state and the expiry back; they replicate as HSET and PEXPIREAT, the
    /// effects, never the command, since the result depends on the primary's clock.
    fn write(&mut self, ctx: &Ctx, state: &State, now_micros: i64) {
        let mut text = ryu::Buffer::new();
        let tokens = OwnedString::new(ctx, format_number(&mut text, state.tokens).as_bytes());
        let ts = OwnedString::new(ctx, format_number(&mut text, state.ts).as_bytes());
        self.key
            .set_fields([(TOKENS.raw(), tokens.raw), (TS.raw(), ts.raw)]);
        self.key.expire_at(bucket::expire_at_millis(
            now_micros,
            state.ts,
            self.limit.period,
        ));
    }
}

/// `count period`, then the trailing `[COST n]`: TAKE's and PEEK's arguments.
const TAKE_ARGS: &[Arg] = &[
    Arg::key(c"key", 0),
    Arg::integer(c"count"),
    Arg::double(c"period"),
    Arg::integer(c"cost").token(c"COST").optional(),
];

static TAKE: CallCounters = CallCounters::new();
static TAKE_PAIR: CallCounters = CallCounters::new();
static PEEK: CallCounters = CallCounters::new();

/// QAG.TAKE key count period [COST n]
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
        let take = bucket::parse_take(args)?;
        let mut bucket = Bucket::open(ctx, args, take.key, take.limit, Access::ReadWrite)?;
        let now = ctx.now_micros();
        let outcome = bucket.take(take.cost, now);
        bucket.write(ctx, &outcome.state, now);
        TAKE.allowed_or_refused(outcome.verdict.allowed);
        Ok(Reply::Array(outcome.verdict.as_reply().into()))
    }
}

/// QAG.TAKE2 ckey ccount cperiod kkey kcount kperiod [COST n]
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
    ];
    const COUNTERS: &'static CallCounters = &TAKE_PAIR;
    const OUTCOMES: &'static [&'static str] = &["allowed", "refused_client", "refused_key"];

    fn run(ctx: &Ctx, args: &RawArgs) -> Result<Reply, CommandError> {
        let (client, key) = Self::take_both(ctx, args)?;
        TAKE_PAIR.decided(match key {
            None => REFUSED,
            Some(key) if !key.allowed => REFUSED_KEY,
            Some(_) => ALLOWED,
        });
        Ok(Reply::Pair(
            client.as_reply().into(),
            key.map(|key| key.as_reply().into()),
        ))
    }
}

impl TakePair {
    /// The client bucket's verdict, and the key bucket's when it was counted.
    fn take_both(ctx: &Ctx, args: &RawArgs) -> Result<(Verdict, Option<Verdict>), CommandError> {
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
        let client_outcome = client.take(cost, now);
        let client_verdict = client_outcome.verdict;

        if args.get(pair.client.key) == args.get(pair.key.key) {
            // One key as both buckets: the script run twice on it, through one handle.
            client.write(ctx, &client_outcome.state, now);
            if !client_verdict.allowed {
                return Ok((client_verdict, None));
            }
            let mut again = Bucket {
                limit: pair.key.limit,
                ..client
            };
            let outcome = again.take(cost, now);
            again.write(ctx, &outcome.state, now);
            return Ok((client_verdict, Some(outcome.verdict)));
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
            client.write(ctx, &client_outcome.state, now);
            return Ok((client_verdict, None));
        }
        // Both keys are open and of the right type before either is written.
        let mut key = Bucket::open(ctx, args, pair.key.key, pair.key.limit, Access::ReadWrite)?;
        let key_outcome = key.take(cost, now);
        client.write(ctx, &client_outcome.state, now);
        key.write(ctx, &key_outcome.state, now);
        Ok((client_verdict, Some(key_outcome.verdict)))
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
    const ARGS: &'static [Arg] = TAKE_ARGS;
    const COUNTERS: &'static CallCounters = &PEEK;

    fn run(ctx: &Ctx, args: &RawArgs) -> Result<Reply, CommandError> {
        let peek = bucket::parse_take(args)?;
        let bucket = Bucket::open(ctx, args, peek.key, peek.limit, Access::Read)?;
        let outcome = bucket.take(peek.cost, ctx.now_micros());
        Ok(Reply::Array(outcome.verdict.as_reply().into()))
    }
}

static REFUND: CallCounters = CallCounters::new();

/// QAG.REFUND key count period n: gives tokens back to a bucket.
pub struct Refund;

impl Command for Refund {
    const NAME: &'static CStr = c"qag.refund";
    const FLAGS: &'static CStr = c"write deny-oom fast";
    const ARITY: i32 = 5;
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
    ];
    const COUNTERS: &'static CallCounters = &REFUND;

    fn run(ctx: &Ctx, args: &RawArgs) -> Result<Reply, CommandError> {
        let refund = bucket::parse_refund(args)?;
        let mut bucket = Bucket::open(ctx, args, refund.key, refund.limit, Access::ReadWrite)?;
        let now = ctx.now_micros();
        let seconds = bucket::seconds_from_micros(now);
        let outcome = bucket::refund(refund.limit, refund.amount, bucket.stored(seconds), seconds);
        if let Some(state) = &outcome.state {
            bucket.write(ctx, state, now);
        }
        Ok(Reply::Integer(outcome.tokens_left))
    }
}
