//! The token-bucket family: QAG.TAKE, QAG.TAKE2 and QAG.PEEK, the native twins of
//! `lua/token_bucket.lua` on the same hash (`tokens`, `ts`).

use std::ffi::CStr;

use qag_core::args::ArgList;
use qag_core::bucket::{self, State, TakeArgs};
use qag_core::number::format_number;
use redis_module::raw;

use crate::command::{Command, CommandError, Ctx, KeyLayout, RawArgs, Reply};
use crate::key::{Access, Key, OwnedString};

const TOKENS: &CStr = c"tokens";
const TS: &CStr = c"ts";

fn read_state(ctx: &Ctx, key: &Key) -> Option<State> {
    let [tokens, ts] = key.hash_get2(ctx, [TOKENS, TS]);
    bucket::parse_state(
        tokens.as_ref().map(OwnedString::bytes),
        ts.as_ref().map(OwnedString::bytes),
    )
}

/// Takes from the bucket open at `key` (named `name`), writes the new state and expiry
/// back and replicates them as HSET and PEXPIREAT: the effects, never the command,
/// since the result depends on the primary's clock.
fn take_and_write(
    ctx: &Ctx,
    key: &mut Key,
    name: *mut raw::RedisModuleString,
    args: &TakeArgs,
    now_micros: i64,
) -> [i64; 3] {
    let now = bucket::seconds_from_micros(now_micros);
    let take = bucket::take(args.limit, args.cost, read_state(ctx, key), now);
    let expire_at = bucket::expire_at_millis(now_micros, args.limit.period);

    let mut text = ryu::Buffer::new();
    let tokens = OwnedString::new(ctx, format_number(&mut text, take.state.tokens));
    let ts = OwnedString::new(ctx, format_number(&mut text, take.state.ts));
    key.hash_set2([(TOKENS, &tokens), (TS, &ts)]);
    key.set_expire_at(expire_at);
    ctx.replicate_hset2(name, [(TOKENS, tokens.raw), (TS, ts.raw)]);
    ctx.replicate_pexpireat(name, expire_at);
    ctx.notify(raw::REDISMODULE_NOTIFY_HASH, c"hset", name);
    ctx.notify(raw::REDISMODULE_NOTIFY_GENERIC, c"expire", name);
    take.verdict.as_reply()
}

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

    fn run(ctx: &Ctx, args: &RawArgs) -> Result<Reply, CommandError> {
        let take = bucket::parse_take(args)?;
        let name = args.string(take.key);
        let mut key = Key::open_hash(ctx, name, Access::ReadWrite)?;
        let reply = take_and_write(ctx, &mut key, name, &take, ctx.now_micros());
        Ok(Reply::Integers(reply))
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

    fn run(ctx: &Ctx, args: &RawArgs) -> Result<Reply, CommandError> {
        let pair = bucket::parse_take_pair(args)?;
        let client_name = args.string(pair.client.key);
        let key_name = args.string(pair.key.key);
        let same_key = args.get(pair.client.key) == args.get(pair.key.key);

        let mut client = Key::open_hash(ctx, client_name, Access::ReadWrite)?;
        if !same_key {
            // Only a type check: the key bucket is opened for writing only if counted.
            Key::open_hash(ctx, key_name, Access::Read)?;
        }
        let now = ctx.now_micros();
        let client_reply = take_and_write(ctx, &mut client, client_name, &pair.client, now);
        if client_reply[0] == 0 {
            return Ok(Reply::Pair(client_reply, None));
        }
        let key_reply = if same_key {
            take_and_write(ctx, &mut client, client_name, &pair.key, now)
        } else {
            drop(client);
            let mut key = Key::open_hash(ctx, key_name, Access::ReadWrite)?;
            take_and_write(ctx, &mut key, key_name, &pair.key, now)
        };
        Ok(Reply::Pair(client_reply, Some(key_reply)))
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

    fn run(ctx: &Ctx, args: &RawArgs) -> Result<Reply, CommandError> {
        let peek = bucket::parse_take(args)?;
        let key = Key::open_hash(ctx, args.string(peek.key), Access::Read)?;
        let now = bucket::seconds_from_micros(ctx.now_micros());
        let take = bucket::take(peek.limit, peek.cost, read_state(ctx, &key), now);
        Ok(Reply::Integers(take.verdict.as_reply()))
    }
}
