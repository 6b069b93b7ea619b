//! The sliding-window family: QAG.ADMIT and QAG.RECORD, requests and tokens per window
//! across a chain of scopes, each a hash with fields `req:<n>` and `tok:<n>` for window
//! number n.

use std::ffi::CStr;

use qag_core::number::stored_count;
use qag_core::window::{self, Clock, Counters, FieldName, Kind};

use crate::command::{Command, CommandError, Ctx, KeyLayout, RawArgs, Reply};
use crate::key::{Access, Key, OwnedString, RawString, ValueType};

/// The field names one call reads and writes: the current and previous windows'. The
/// same for every scope, so made once per call.
struct Fields {
    requests: OwnedString,
    previous_requests: OwnedString,
    tokens: OwnedString,
    previous_tokens: OwnedString,
}

impl Fields {
    fn new(ctx: &Ctx, clock: &Clock) -> Fields {
        let n = clock.window();
        let name = |kind, window| OwnedString::new(ctx, FieldName::new(kind, window).as_bytes());
        Fields {
            requests: name(Kind::Requests, n),
            previous_requests: name(Kind::Requests, n - 1),
            tokens: name(Kind::Tokens, n),
            previous_tokens: name(Kind::Tokens, n - 1),
        }
    }
}

/// Opens every key of the chain for writing, checking all their types before any is
/// written.
fn open_all<'ctx>(
    ctx: &'ctx Ctx,
    args: &RawArgs,
    keys: impl Iterator<Item = usize>,
) -> Result<Vec<Key<'ctx>>, CommandError> {
    keys.map(|index| Key::open(ctx, args.string(index), Access::ReadWrite, ValueType::Hash))
        .collect()
}

fn counters(key: &Key, fields: &Fields) -> Counters {
    let [requests, previous_requests, tokens, previous_tokens] = key.hash_get([
        fields.requests.raw,
        fields.previous_requests.raw,
        fields.tokens.raw,
        fields.previous_tokens.raw,
    ]);
    let value = |s: &Option<OwnedString>| stored_count(s.as_ref().map(OwnedString::bytes));
    Counters {
        requests: value(&requests),
        previous_requests: value(&previous_requests),
        tokens: value(&tokens),
        previous_tokens: value(&previous_tokens),
    }
}

/// Sets one counter of a scope, removes its windows that no longer count and moves its
/// expiry two windows on.
fn write(ctx: &Ctx, key: &mut Key, field: RawString, value: i64, clock: &Clock) {
    let value = OwnedString::from_integer(ctx, value);
    key.set_fields([(field, value.raw)]);
    let stale = key.hash_fields_where(&|name| window::is_stale(name, clock));
    key.delete_fields(&stale.iter().map(|s| s.raw).collect::<Vec<_>>());
    key.expire_at(clock.expire_at_millis());
}

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

    fn run(ctx: &Ctx, args: &RawArgs) -> Result<Reply, CommandError> {
        let call = window::parse_admit(args)?;
        let clock = Clock::new(call.window_seconds, ctx.now_micros());
        let mut keys = open_all(ctx, args, call.scopes.iter().map(|(key, _)| *key))?;
        let fields = Fields::new(ctx, &clock);
        let state: Vec<_> = keys
            .iter()
            .zip(&call.scopes)
            .map(|(key, (_, limits))| (*limits, counters(key, &fields)))
            .collect();
        let admission = window::admit(&state, &clock);
        if admission.admitted {
            for (key, (_, counters)) in keys.iter_mut().zip(&state) {
                let requests = counters.requests.saturating_add(1);
                write(ctx, key, fields.requests.raw, requests, &clock);
            }
        }
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

    fn run(ctx: &Ctx, args: &RawArgs) -> Result<Reply, CommandError> {
        let call = window::parse_record(args)?;
        let clock = Clock::new(call.window_seconds, ctx.now_micros());
        let mut keys = open_all(ctx, args, call.keys.iter().copied())?;
        let fields = Fields::new(ctx, &clock);
        // Every new count is computed, and checked, before any is written.
        let totals = keys
            .iter()
            .map(|key| counters(key, &fields).tokens.checked_add(call.tokens))
            .collect::<Option<Vec<i64>>>()
            .ok_or(CommandError::Refused(
                "ERR the token count would overflow; nothing was charged",
            ))?;
        for (key, total) in keys.iter_mut().zip(totals) {
            write(ctx, key, fields.tokens.raw, total, &clock);
        }
        Ok(Reply::Integer(keys.len() as i64))
    }
}
