//! The quota family: QAG.QUOTA, QAG.QUOTA.ADD and QAG.QUOTA.SEED. A caller's usage in
//! the current calendar period lives in a hash: `period` (its label), `calls`, `rows`.

use std::ffi::CStr;

use qag_core::quota::{self, Period, QuotaArgs, Usage};

use crate::command::{Arg, Command, CommandError, Ctx, KeyLayout, RawArgs, Reply, Row};
use crate::key::{Access, FieldName, Key, OwnedString, ValueType};
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

/// A quota key opened for one call, with the period the call counts into and the
/// usage stored for it.
struct Quota<'ctx> {
    key: Key<'ctx>,
    period: Period,
    usage: Usage,
}

impl<'ctx> Quota<'ctx> {
    fn open(
        ctx: &'ctx Ctx,
        args: &RawArgs,
        call: &QuotaArgs,
        access: Access,
    ) -> Result<Self, CommandError> {
        let key = Key::open(ctx, args.string(call.key), access, ValueType::Hash)?;
        let [label, calls, rows] = key.hash_get([PERIOD.raw(), CALLS.raw(), ROWS.raw()]);
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
        Ok(Quota { key, period, usage })
    }

    /// Writes `usage` when it changes a count (else nothing), and replies it.
    fn count(&mut self, ctx: &Ctx, usage: Usage) -> Reply {
        match quota::to_write(self.usage, usage) {
            Some(usage) => self.write(ctx, usage),
            None => Reply::Array([usage.calls, usage.rows, self.period.end].into()),
        }
    }

    /// Writes the period's usage and the key's expiry, a day after the period ends.
    fn write(&mut self, ctx: &Ctx, usage: Usage) -> Reply {
        let label = OwnedString::new(ctx, self.period.label.as_bytes());
        let calls = OwnedString::from_integer(ctx, usage.calls);
        let rows = OwnedString::from_integer(ctx, usage.rows);
        self.key.set_fields([
            (PERIOD.raw(), label.raw),
            (CALLS.raw(), calls.raw),
            (ROWS.raw(), rows.raw),
        ]);
        self.key.expire_at(self.period.expire_at_millis());
        Reply::Array([usage.calls, usage.rows, self.period.end].into())
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
        let call = quota::parse_quota(args)?;
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

/// QAG.QUOTA.ADD key PER day|month TZ zone CALLS n ROWS m
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
    const ARGS: &'static [Arg] = QUOTA_ARGS;
    const COUNTERS: &'static CallCounters = &ADD;

    fn run(ctx: &Ctx, args: &RawArgs) -> Result<Reply, CommandError> {
        let call = quota::parse_quota(args)?;
        let mut quota = Quota::open(ctx, args, &call, Access::ReadWrite)?;
        let usage = quota::add(quota.usage, call.counts()).ok_or(CommandError::Refused(
            "ERR the count would overflow; nothing was added",
        ))?;
        Ok(quota.count(ctx, usage))
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
        let call = quota::parse_quota(args)?;
        let mut quota = Quota::open(ctx, args, &call, Access::ReadWrite)?;
        let usage = quota::seed(quota.usage, call.counts());
        Ok(quota.count(ctx, usage))
    }
}
