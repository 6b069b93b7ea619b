//! Takes once from a token bucket and prints the decision on one line:
//!
//! ```sh
//! cargo run -p qag-client --example take -- [--backend auto|module|script] [--cost N] URL KEY COUNT PERIOD
//! allowed=1 remaining=59 retry_after=0 backend=module
//! ```
//!
//! An error goes to standard error, with exit status 1 (2 for bad usage).

use std::process::ExitCode;

use qag_client::{Backend, Bucket, Limiter, Options};

const USAGE: &str = "usage: take [--backend auto|module|script] [--cost N] URL KEY COUNT PERIOD";

struct Call {
    backend: Backend,
    cost: u64,
    url: String,
    key: String,
    count: u64,
    period: f64,
}

fn parse(mut args: impl Iterator<Item = String>) -> Result<Call, String> {
    let mut backend = Backend::Auto;
    let mut cost = 1;
    let mut positional = Vec::new();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--backend" => {
                backend = match args.next().as_deref() {
                    Some("auto") => Backend::Auto,
                    Some("module") => Backend::Module,
                    Some("script") => Backend::Script,
                    other => {
                        return Err(format!("--backend: auto, module or script, not {other:?}"))
                    }
                }
            }
            "--cost" => {
                let value = args.next().unwrap_or_default();
                cost = value
                    .parse()
                    .map_err(|_| format!("--cost: a whole number, not {value:?}"))?;
            }
            _ => positional.push(arg),
        }
    }
    let [url, key, count, period] = <[String; 4]>::try_from(positional)
        .map_err(|_| "URL, KEY, COUNT and PERIOD are required".to_string())?;
    Ok(Call {
        backend,
        cost,
        count: count
            .parse()
            .map_err(|_| format!("COUNT: a whole number, not {count:?}"))?,
        period: period
            .parse()
            .map_err(|_| format!("PERIOD: a number of seconds, not {period:?}"))?,
        url,
        key,
    })
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let call = match parse(std::env::args().skip(1)) {
        Ok(call) => call,
        Err(why) => {
            eprintln!("take: {why}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let answer = async {
        let options = Options {
            backend: call.backend,
            ..Options::default()
        };
        // Connecting is part of the call: bounded by the same deadline.
        Limiter::connect(&call.url, options)
            .await?
            .take(
                &Bucket::with_key(&call.key, call.count, call.period),
                call.cost,
            )
            .await
    };
    match answer.await {
        Ok(decision) => {
            println!(
                "allowed={} remaining={} retry_after={} backend={}",
                u8::from(decision.allowed),
                decision.remaining,
                decision.retry_after,
                decision.answered_by
            );
            ExitCode::SUCCESS
        }
        Err(why) => {
            eprintln!("take: {why}");
            ExitCode::FAILURE
        }
    }
}
