//! Test events for the log's formats: every kind of field the balancer logs and the
//! awkward ones, which each format's test writes with its own code and with
//! `tracing_subscriber`'s, requiring the same text.

/// How many events [`emit`] sends.
pub const EVENTS: usize = 9;

/// Sends the sample events to the current subscriber.
pub fn emit() {
    let error = std::io::Error::other("engine \"gone\"");
    tracing::info!(
        pool = "mock",
        node = "n0",
        route = %"spill:2",
        attempts = 1u32,
        status = 200u16,
        ttft_ms = Some(4u64),
        cached = None::<u64>,
        duration_ms = u64::MAX,
        delta = -42i64,
        least = i64::MIN,
        zero = 0u64,
        ok = true,
        "request"
    );
    tracing::warn!(
        text = "a \"quoted\" word\\ and a tab\t, é, \u{1b}[31m, \u{7f}",
        empty = "",
        r#type = "raw name",
        error = &error as &(dyn std::error::Error + 'static),
        debug = ?vec!["a", "b"],
        ratio = 0.25f64,
        huge = 1e300f64,
        nan = f64::NAN,
        wide = u128::MAX,
        "a message with \"quotes\"\nand \u{1b}[2m escapes"
    );
    tracing::info!(
        log.target = "redis::cmd",
        log.module_path = "redis::cmd",
        log.line = 12u64,
        "fields named as the log crate's relayed events name theirs"
    );
    tracing::info!(log.file = "x.rs", kept = 3u64);
    tracing::info!(first = 1u64, "message after a field");
    tracing::info!(message = "a message given as a string", after = 2u64);
    tracing::info!(only = "fields", off = false);
    tracing::error!(target: "a \"strange\" target", only = 1u64);
    let span = tracing::info_span!("outer", id = 7u64);
    let _in = span.enter();
    tracing::info!(inside = true, "in a span");
}
