//! The quota family: QAG.QUOTA, QAG.QUOTA.ADD and QAG.QUOTA.SEED. A caller's usage in
//! the current calendar period lives in a hash: `period` (its label), `calls`, `rows`.

use std::ffi::CStr;
use std::ptr;

use qag_core::number::{format_signed, NumberBuffer};
use qag_core::quota::{self, Period, QuotaArgs, Usage};

use crate::command::{Arg, Command, KeyLayout, RawArgs, Reply, Row, ID_ARG};
use crate::key::{Access, FieldName, Key, OwnedString, ValueType};
use crate::replay::RequestId;
use crate::server::{CommandError, Ctx};
use crate::stats::CallCounters;

static PERIOD: FieldName = FieldName::new("period");
static CALLS: FieldName = FieldName::new("calls");
static ROWS: FieldName = FieldName::new("rows");

/// Makes the field names; called once when the module loads.
pub fn init() {
    PERIOD.create();
    CALLS.create();
    ROWS.create();
}

/// A quota key opened for one call, with the period the call counts into, the usage
/// stored for it, and the stored fields (period, calls, rows) as read.
struct Quota<'ctx> {
    key: Key<'ctx>,
    period: Period,
    usage: Usage,
    stored: [Option<OwnedString>; 3],
}

impl<'ctx> Quota<'ctx> {
    fn open(
        ctx: &'ctx Ctx,
        args: &RawArgs,
        call: &QuotaArgs,
        access: Access,
    ) -> Result<Self, CommandError> {
        let key = Key::open(ctx, args.string(call.key), access, ValueType::Hash)?;
        let stored = key.hash_get([PERIOD.raw(), CALLS.raw(), ROWS.raw()]);
        let [label, calls, rows] = &stored;
        let label = label.as_ref().map(OwnedString::bytes);
        let period = quota::counting_period(call.per, &call.zone, ctx.now_micros(), label).ok_or(
            CommandError::Refused("ERR the server clock is outside the calendar's range"),
        )?;
        let usage = quota::usage(
            label,
            calls.as_ref().map(OwnedString::bytes),
            rows.as_ref().map(OwnedString::bytes),
            &period,
        );
        Ok(Quota {
            key,
            period,
            usage,
            stored,
        })
    }

    /// Writes `usage` when it changes a count, and the request id the call remembers
    /// (else nothing), in one HSET, with the key's expiry a day after the period ends
    /// (longer than any id is kept); replies it. Of the three usage fields, only those
    /// whose stored text is not already the one to write (an ADD of calls in the same
    /// period writes `calls` alone), which leaves the hash as writing all three would.
    fn count(&mut self, ctx: &Ctx, usage: Usage, id: Option<RequestId>, now_millis: i64) -> Reply {
        let reply = Reply::Array([usage.calls, usage.rows, self.period.end].into());
        let remembered = id.map(|id| id.remember(ctx, &mut self.key, &reply, now_millis));
        let mut fields = [(ptr::null_mut(), ptr::null_mut()); 4];
        let mut written = 0;
        if let Some(r) = &remembered {
            fields[written] = r.field();
            written += 1;
        }
        let (mut calls_text, mut rows_text) = (NumberBuffer::new(), NumberBuffer::new());
        let mut values: [Option<OwnedString>; 3] = [None, None, None];
        if let Some(usage) = quota::to_write(self.usage, usage) {
            let texts = [
                self.period.label.as_bytes(),
                format_signed(&mut calls_text, usage.calls).as_bytes(),
                format_signed(&mut rows_text, usage.rows).as_bytes(),
            ];
            let names = [PERIOD.raw(), CALLS.raw(), ROWS.raw()];
            for (i, text) in texts.into_iter().enumerate() {
                if self.stored[i].as_ref().map(OwnedString::bytes) != Some(text) {
                    let value = OwnedString::new(ctx, text);
                    fields[written] = (names[i], value.raw);
                    values[i] = Some(value);
                    written += 1;
                }
            }
        }
        if written > 0 {
            self.key.set_fields(&fields[..written]);
            self.key.expire_at(self.period.expire_at_millis());
        }
        reply
    }
}

/// `key PER day|month TZ zone [CALLS n] [ROWS n]`, every command's (in any order after
/// the key; at least one of CALLS and ROWS).
const QUOTA_ARGS: &[Arg] = &[
    Arg::key(c"key", 0),
    Arg::one_of(c"per", &[Arg::word(c"day"), Arg::word(c"month")]).token(c"PER"),
    Arg::string(c"zone").token(c"TZ"),
    Arg::integer(c"calls").token(c"CALLS").optional(),
    Arg::integer(c"rows").token(c"ROWS").optional(),
];

const ADD_ARGS: &[Arg] = &[
    QUOTA_ARGS[0],
    QUOTA_ARGS[1],
    QUOTA_ARGS[2],
    QUOTA_ARGS[3],
    QUOTA_ARGS[4],
    ID_ARG,
];

static CHECK: CallCounters = CallCounters::new();
static ADD: CallCounters = CallCounters::new();
static SEED: CallCounters = CallCounters::new();

/// QAG.QUOTA key PER day|month TZ zone [CALLS limit] [ROWS limit]
pub struct Check;

impl Command for Check {
    const NAME: &'static CStr = c"qag.quota";
    const FLAGS: &'static CStr = c"readonly fast";
    const ARITY: i32 = -6;
    const KEYS: KeyLayout = KeyLayout::Single;
    const WRITES: bool = false;
    const SUMMARY: &'static CStr =
        c"Checks a calendar quota before a call; replies [allowed, calls remaining, rows remaining, resets at]";
    const COMPLEXITY: &'static CStr = c"O(1)";
    const ARGS: &'static [Arg] = QUOTA_ARGS;
    const COUNTERS: &'static CallCounters = &CHECK;
    const OUTCOMES: &'static [&'static str] = &["allowed", "refused"];

    fn run(ctx: &Ctx, args: &RawArgs) -> Result<Reply, CommandError> {
        let call = quota::parse_quota(args, false)?;
        let quota = Quota::open(ctx, args, &call, Access::Read)?;
        let check = quota::check(quota.usage, call.limits());
        CHECK.allowed_or_refused(check.allowed);
        Ok(Reply::Array(Row::new(&[
            Some(i64::from(check.allowed)),
            check.calls_remaining,
            check.rows_remaining,
            Some(quota.period.end),
        ])))
    }
}

/// QAG.QUOTA.ADD key PER day|month TZ zone CALLS n ROWS m [ID request-id]
pub struct Add;

impl Command for Add {
    const NAME: &'static CStr = c"qag.quota.add";
    const FLAGS: &'static CStr = c"write deny-oom fast";
    const ARITY: i32 = -6;
    const KEYS: KeyLayout = KeyLayout::Single;
    const WRITES: bool = true;
    const SUMMARY: &'static CStr =
        c"Counts a call's calls and rows into the current period; replies [calls used, rows used, resets at]";
    const COMPLEXITY: &'static CStr = c"O(1)";
    const ARGS: &'static [Arg] = ADD_ARGS;
    const COUNTERS: &'static CallCounters = &ADD;

    fn run(ctx: &Ctx, args: &RawArgs) -> Result<Reply, CommandError> {
        let call = quota::parse_quota(args, true)?;
        let mut quota = Quota::open(ctx, args, &call, Access::ReadWrite)?;
        let now_millis = ctx.now_micros() / 1000;
        let id = call
            .id
            .map(|id| RequestId::read(ctx, &quota.key, "quota.add", args, id, now_millis));
        if let Some(reply) = id.as_ref().and_then(RequestId::replay) {
            return Ok(reply);
        }
        let usage = quota::add(quota.usage, call.counts()).ok_or(CommandError::Refused(
            "ERR the count would overflow; nothing was added",
        ))?;
        Ok(quota.count(ctx, usage, id, now_millis))
    }
}

/// QAG.QUOTA.SEED key PER day|month TZ zone CALLS n ROWS m
pub struct Seed;

impl Command for Seed {
    const NAME: &'static CStr = c"qag.quota.seed";
    const FLAGS: &'static CStr = c"write deny-oom fast";
    const ARITY: i32 = -6;
    const KEYS: KeyLayout = KeyLayout::Single;
    const WRITES: bool = true;
    const SUMMARY: &'static CStr =
        c"Raises the current period's counts to at least the seeds; replies [calls used, rows used, resets at]";
    const COMPLEXITY: &'static CStr = c"O(1)";
    const ARGS: &'static [Arg] = QUOTA_ARGS;
    const COUNTERS: &'static CallCounters = &SEED;

    fn run(ctx: &Ctx, args: &RawArgs) -> Result<Reply, CommandError> {
        let call = quota::parse_quota(args, false)?;
        let mut quota = Quota::open(ctx, args, &call, Access::ReadWrite)?;
        let usage = quota::seed(quota.usage, call.counts());
        Ok(quota.count(ctx, usage, None, 0))
    }
}
