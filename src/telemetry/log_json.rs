//! The JSON log's lines (`--log-format json`): the same text as `tracing_subscriber`'s
//! JSON format (`{"timestamp":…,"level":…,"fields":{…},"target":…}`), written
//! directly instead of through `serde_json`'s serializer over a `fmt::Write` adaptor,
//! which at `info` (a line per request) cost more than the rest of a small request's
//! log. Plain strings, integers and booleans are copied in; escaped strings and
//! floats are written by `serde_json`; the timestamp by [`super::log_time`]. An event
//! inside a span, or one relayed from the `log` crate, is handed to the stock format
//! whole, since only it knows how to write those.

use std::fmt;

use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::{Format, Json, Writer};
use tracing_subscriber::fmt::time::FormatTime;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// `event_format` of the JSON log.
#[derive(Debug, Clone)]
pub struct JsonLines {
    stock: Format<Json>,
}

impl Default for JsonLines {
    fn default() -> Self {
        JsonLines {
            stock: tracing_subscriber::fmt::format().json(),
        }
    }
}

impl<S, N> FormatEvent<S, N> for JsonLines
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let meta = event.metadata();
        if meta.target() == "log" || event.parent().is_some() || ctx.lookup_current().is_some() {
            return self.stock.format_event(ctx, writer, event);
        }
        writer.write_str("{\"timestamp\":\"")?;
        super::log_time::SecondsKept.format_time(&mut writer)?;
        writer.write_str("\",\"level\":\"")?;
        writer.write_str(meta.level().as_str())?;
        writer.write_str("\",\"fields\":{")?;
        let mut fields = JsonFields {
            writer: writer.by_ref(),
            first: true,
            result: Ok(()),
        };
        event.record(&mut fields);
        fields.result?;
        writer.write_str("},\"target\":")?;
        string(&mut writer, meta.target())?;
        writer.write_str("}\n")
    }
}

/// `text` as a JSON string: copied between quotes when nothing in it needs escaping.
fn string(writer: &mut Writer<'_>, text: &str) -> fmt::Result {
    if text.bytes().all(|b| b >= b' ' && b != b'"' && b != b'\\') {
        writer.write_char('"')?;
        writer.write_str(text)?;
        writer.write_char('"')
    } else {
        writer.write_str(&serde_json::to_string(text).map_err(|_| fmt::Error)?)
    }
}

/// Writes an event's fields as the members of a JSON object.
struct JsonFields<'w> {
    writer: Writer<'w>,
    first: bool,
    result: fmt::Result,
}

impl JsonFields<'_> {
    /// The separating comma, the name and the colon, then the value.
    fn member(&mut self, field: &Field, value: impl FnOnce(&mut Writer<'_>) -> fmt::Result) {
        if self.result.is_err() {
            return;
        }
        let writer = &mut self.writer;
        let first = std::mem::take(&mut self.first);
        self.result = (|| {
            if !first {
                writer.write_char(',')?;
            }
            string(writer, field.name())?;
            writer.write_char(':')?;
            value(writer)
        })();
    }
}

impl Visit for JsonFields<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.member(field, |w| string(w, value));
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.member(field, |w| {
            w.write_str(crate::decimal::digits(value, &mut [0; 20]))
        });
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.member(field, |w| {
            if value < 0 {
                w.write_char('-')?;
            }
            w.write_str(crate::decimal::digits(value.unsigned_abs(), &mut [0; 20]))
        });
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.member(field, |w| w.write_str(if value { "true" } else { "false" }));
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.member(field, |w| {
            w.write_str(&serde_json::to_string(&value).map_err(|_| fmt::Error)?)
        });
    }

    /// Everything else (errors, 128-bit integers and bytes come here too), as the
    /// stock format writes it: its `Debug` text as a string.
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.member(field, |w| string(w, &format!("{value:?}")));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use parking_lot::Mutex;
    use tracing_subscriber::fmt::MakeWriter;

    /// A log written into memory.
    #[derive(Clone, Default)]
    struct Memory(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Memory {
        fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
            self.0.lock().extend_from_slice(data);
            Ok(data.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Memory {
        type Writer = Memory;

        fn make_writer(&'a self) -> Memory {
            self.clone()
        }
    }

    impl Memory {
        /// The lines, each with its timestamp's value blanked (the two formats read
        /// the clock at different instants).
        fn lines(&self) -> Vec<String> {
            let text = String::from_utf8(self.0.lock().clone()).unwrap();
            text.lines()
                .map(|line| {
                    let start = line.find("\"timestamp\":\"").unwrap() + 13;
                    let end = start + line[start..].find('"').unwrap();
                    format!("{}T{}", &line[..start], &line[end..])
                })
                .collect()
        }
    }

    /// The sample events (every kind of field the balancer logs, and awkward ones)
    /// come out as the stock JSON format writes them, in the same order, byte for
    /// byte.
    #[test]
    fn lines_read_as_the_stock_json_format_writes_them() {
        use tracing_subscriber::layer::SubscriberExt;
        let (ours, stock) = (Memory::default(), Memory::default());
        let subscriber = tracing_subscriber::registry()
            .with(
                tracing_subscriber::fmt::layer()
                    .json()
                    .event_format(JsonLines::default())
                    .with_writer(ours.clone()),
            )
            .with(
                tracing_subscriber::fmt::layer()
                    .json()
                    .with_writer(stock.clone()),
            );
        tracing::subscriber::with_default(subscriber, super::super::log_samples::emit);
        let (ours, stock) = (ours.lines(), stock.lines());
        assert_eq!(ours.len(), super::super::log_samples::EVENTS);
        assert_eq!(ours, stock);
        assert!(
            ours[0].starts_with(
                "{\"timestamp\":\"T\",\"level\":\"INFO\",\"fields\":{\"message\":\"request\",\
                 \"pool\":\"mock\",\"node\":\"n0\",\"route\":\"spill:2\",\"attempts\":1,"
            ),
            "{}",
            ours[0]
        );
    }
}
