//! The sliding-window family: QAG.ADMIT and QAG.RECORD, requests and tokens per window
//! across a chain of scopes, each a hash with fields `req:<n>` and `tok:<n>` for window
//! number n.

use std::ffi::CStr;

use qag_core::number::stored_count;
use qag_core::window::{self, Clock, Counters, FieldName, Kind};

use crate::command::{Arg, Command, CommandError, Ctx, KeyLayout, RawArgs, Reply};
use crate::key::{Access, Key, OwnedString, ValueType};
use crate::stats::CallCounters;

/// The call's clock and the field names it reads and writes: the current and previous
/// windows'. The same for every scope, so made once per call.
struct Fields {
    clock: Clock,
    requests: OwnedString,
    previous_requests: OwnedString,
    tokens: OwnedString,
    previous_tokens: OwnedString,
}

impl Fields {
    fn new(ctx: &Ctx, clock: Clock) -> Fields {
        let n = clock.window();
        let name = |kind, window| OwnedString::new(ctx, FieldName::new(kind, window).as_bytes());
        Fields {
            clock,
            requests: name(Kind::Requests, n),
            previous_requests: name(Kind::Requests, n - 1),
            tokens: name(Kind::Tokens, n),
            previous_tokens: name(Kind::Tokens, n - 1),
        }
    }
}

/// Every scope of a call: its key, opened for writing, and what it holds. All keys are
/// opened, and their types checked, before any is written.
struct Chain<'ctx> {
    keys: Vec<Key<'ctx>>,
    scopes: Vec<Scope>,
    fields: Fields,
}

impl<'ctx> Chain<'ctx> {
    fn open(
        ctx: &'ctx Ctx,
        args: &RawArgs,
        keys: impl Iterator<Item = usize>,
        window_seconds: i64,
    ) -> Result<Chain<'ctx>, CommandError> {
        let clock = Clock::new(window_seconds, ctx.now_micros());
        let keys = keys
            .map(|index| Key::open(ctx, args.string(index), Access::ReadWrite, ValueType::Hash))
            .collect::<Result<Vec<_>, _>>()?;
        let fields = Fields::new(ctx, clock);
        let scopes = keys.iter().map(|key| Scope::read(key, &fields)).collect();
        Ok(Chain {
            keys,
            scopes,
            fields,
        })
    }

    /// Sets one current counter of every scope, in order, to `values`.
    fn write(&mut self, ctx: &Ctx, counter: Kind, values: Vec<i64>) {
        for ((key, scope), value) in self.keys.iter_mut().zip(&self.scopes).zip(values) {
            scope.write(ctx, key, &self.fields, counter, value);
        }
    }
}

/// A scope as read: its counters, and which of the four counter fields its hash holds.
struct Scope {
    counters: Counters,
    has_requests: bool,
    has_tokens: bool,
    held: usize,
}

impl Scope {
    fn read(key: &Key, fields: &Fields) -> Scope {
        let values = key.hash_get([
            fields.requests.raw,
            fields.previous_requests.raw,
            fields.tokens.raw,
            fields.previous_tokens.raw,
        ]);
        let value = |i: usize| stored_count(values[i].as_ref().map(OwnedString::bytes));
        Scope {
            counters: Counters {
                requests: value(0),
                previous_requests: value(1),
                tokens: value(2),
                previous_tokens: value(3),
            },
            has_requests: values[0].is_some(),
            has_tokens: values[2].is_some(),
            held: values.iter().flatten().count(),
        }
    }

    /// Sets one current counter, removes the scope's windows that no longer count (or
    /// never will by this clock) and moves its expiry to the next window's end (see
    /// `Clock::expiry_after_write`).
    fn write(&self, ctx: &Ctx, key: &mut Key, fields: &Fields, counter: Kind, value: i64) {
        if !self.counters.changes(counter, value) {
            return;
        }
        let (field, had) = match counter {
            Kind::Requests => (&fields.requests, self.has_requests),
            Kind::Tokens => (&fields.tokens, self.has_tokens),
        };
        let value = OwnedString::from_integer(ctx, value);
        key.set_fields([(field.raw, value.raw)]);
        // A hash holding only the two counted windows' fields has nothing stale: the
        // scan for stale fields is needed only when it holds more.
        if key.len() > self.held + usize::from(!had) {
            let stale = key.hash_fields_where(&|name| window::is_stale(name, &fields.clock));
            key.delete_fields(&stale.iter().map(|s| s.raw).collect::<Vec<_>>());
        }
        key.expire_given(|current| fields.clock.expiry_after_write(current));
    }
}

static ADMIT: CallCounters = CallCounters::new();
static RECORD: CallCounters = CallCounters::new();

/// QAG.ADMIT numscopes key rpm tpm [key rpm tpm ...] [WINDOW seconds]
pub struct Admit;

impl Command for Admit {
    const NAME: &'static CStr = c"qag.admit";
    const FLAGS: &'static CStr = c"write deny-oom fast";
    const ARITY: i32 = -5;
    const KEYS: KeyLayout = KeyLayout::Counted { step: 3 };
    const WRITES: bool = true;
    const SUMMARY: &'static CStr = c"Admits a request only if every scope of a chain is under its requests and tokens per window; replies [admitted, refusing scope, retry after, requests remaining, tokens remaining]";
    const COMPLEXITY: &'static CStr = c"O(N) for N scopes";
    const ARGS: &'static [Arg] = &[
        Arg::integer(c"numscopes"),
        Arg::block(
            c"scope",
            &[
                Arg::key(c"key", 0),
                Arg::integer(c"rpm"),
                Arg::integer(c"tpm"),
            ],
        )
        .multiple(),
        Arg::integer(c"seconds").token(c"WINDOW").optional(),
    ];
    const COUNTERS: &'static CallCounters = &ADMIT;
    const OUTCOMES: &'static [&'static str] = &["allowed", "refused"];

    fn run(ctx: &Ctx, args: &RawArgs) -> Result<Reply, CommandError> {
        let call = window::parse_admit(args)?;
        let keys = call.scopes.iter().map(|(key, _)| *key);
        let mut chain = Chain::open(ctx, args, keys, call.window_seconds)?;
        let state: Vec<_> = chain
            .scopes
            .iter()
            .zip(&call.scopes)
            .map(|(scope, (_, limits))| (*limits, scope.counters))
            .collect();
        let admission = window::admit(&state, &chain.fields.clock);
        if admission.admitted {
            let requests = state
                .iter()
                .map(|(_, counters)| counters.requests.saturating_add(1))
                .collect();
            chain.write(ctx, Kind::Requests, requests);
        }
        ADMIT.allowed_or_refused(admission.admitted);
        Ok(Reply::Array(admission.as_reply().into()))
    }
}

/// QAG.RECORD numscopes key [key ...] tokens [WINDOW seconds]
pub struct Record;

impl Command for Record {
    const NAME: &'static CStr = c"qag.record";
    const FLAGS: &'static CStr = c"write deny-oom fast";
    const ARITY: i32 = -4;
    const KEYS: KeyLayout = KeyLayout::Counted { step: 1 };
    const WRITES: bool = true;
    const SUMMARY: &'static CStr =
        c"Charges a response's tokens to the current window of every scope; replies the number of scopes charged";
    const COMPLEXITY: &'static CStr = c"O(N) for N scopes";
    const ARGS: &'static [Arg] = &[
        Arg::integer(c"numscopes"),
        Arg::key(c"key", 0).multiple(),
        Arg::integer(c"tokens"),
        Arg::integer(c"seconds").token(c"WINDOW").optional(),
    ];
    const COUNTERS: &'static CallCounters = &RECORD;

    fn run(ctx: &Ctx, args: &RawArgs) -> Result<Reply, CommandError> {
        let call = window::parse_record(args)?;
        let keys = call.keys.iter().copied();
        let mut chain = Chain::open(ctx, args, keys, call.window_seconds)?;
        // Every new count is computed, and checked, before any is written.
        let totals = chain
            .scopes
            .iter()
            .map(|scope| scope.counters.tokens.checked_add(call.tokens))
            .collect::<Option<Vec<i64>>>()
            .ok_or(CommandError::Refused(
                "ERR the token count would overflow; nothing was charged",
            ))?;
        chain.write(ctx, Kind::Tokens, totals);
        Ok(Reply::Integer(chain.keys.len() as i64))
    }
}
