//! The fields of a text log line written without colour (a file, a pipe, journald):
//! the same text as `tracing_subscriber`'s default (`message name=value …`, strings
//! quoted as `Debug` quotes them), with the common cases written directly. The
//! default goes through `core::fmt` and a colour style for every field, about 13,000
//! instructions for the request line's fields at `info`; plain printable strings,
//! integers and booleans are now copied in (5,600 fewer). Anything else (the message,
//! an escaped string, a `Debug` or `Display` value, an error) is written by the
//! default visitor, so the text stays the same.

use std::fmt;

use tracing::field::{Field, Visit};
use tracing_subscriber::field::{MakeVisitor, VisitFmt, VisitOutput};
use tracing_subscriber::fmt::format::{DefaultVisitor, Writer};

/// `fmt_fields` of the text log when it is not a terminal.
#[derive(Debug, Clone, Copy, Default)]
pub struct PlainFields;

impl<'w> MakeVisitor<Writer<'w>> for PlainFields {
    type Visitor = PlainVisitor<'w>;

    fn make_visitor(&self, writer: Writer<'w>) -> PlainVisitor<'w> {
        PlainVisitor {
            writer,
            first: true,
            result: Ok(()),
        }
    }
}

/// Writes one line's fields, separated by spaces.
pub struct PlainVisitor<'w> {
    writer: Writer<'w>,
    first: bool,
    result: fmt::Result,
}

/// Text that `Debug` leaves as it is between its quotes: printable ASCII, no quote,
/// no backslash.
fn is_plain(text: &str) -> bool {
    text.bytes()
        .all(|b| (b' '..=b'~').contains(&b) && b != b'"' && b != b'\\')
}

impl PlainVisitor<'_> {
    /// Whether `field` is written: not after an error, and not the `log.` fields of an
    /// event relayed from the `log` crate (its metadata, which the line's head shows),
    /// which the default visitor leaves out too.
    fn writes(&self, field: &Field) -> bool {
        self.result.is_ok() && !field.name().starts_with("log.")
    }

    /// The separating space and `name=`.
    fn start(&mut self, field: &Field) -> fmt::Result {
        if !std::mem::take(&mut self.first) {
            self.writer.write_char(' ')?;
        }
        let name = field.name();
        self.writer
            .write_str(name.strip_prefix("r#").unwrap_or(name))?;
        self.writer.write_char('=')
    }

    /// A decimal number.
    fn number(&mut self, field: &Field, negative: bool, n: u64) {
        self.result = self.start(field).and_then(|()| {
            if negative {
                self.writer.write_char('-')?;
            }
            self.writer
                .write_str(crate::decimal::digits(n, &mut [0; 20]))
        });
    }

    /// Anything else, as the default visitor writes it.
    fn by_default(&mut self, write: impl FnOnce(&mut DefaultVisitor<'_>)) {
        let mut default = DefaultVisitor::new(self.writer.by_ref(), self.first);
        write(&mut default);
        self.first = false;
        self.result = default.finish();
    }
}

impl Visit for PlainVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if !self.writes(field) {
            return;
        }
        // The message is written bare, by the default visitor (a macro's message
        // comes to `record_debug` anyway).
        if !is_plain(value) || field.name() == "message" {
            return self.by_default(|d| d.record_str(field, value));
        }
        self.result = self.start(field).and_then(|()| {
            self.writer.write_char('"')?;
            self.writer.write_str(value)?;
            self.writer.write_char('"')
        });
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        if self.writes(field) {
            self.number(field, false, value);
        }
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        if self.writes(field) {
            self.number(field, value < 0, value.unsigned_abs());
        }
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        if self.writes(field) {
            self.result = self
                .start(field)
                .and_then(|()| self.writer.write_str(if value { "true" } else { "false" }));
        }
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        if self.writes(field) {
            self.by_default(|d| d.record_error(field, value));
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if self.writes(field) {
            self.by_default(|d| d.record_debug(field, value));
        }
    }
}

impl VisitOutput<fmt::Result> for PlainVisitor<'_> {
    fn finish(self) -> fmt::Result {
        self.result
    }
}

impl VisitFmt for PlainVisitor<'_> {
    fn writer(&mut self) -> &mut dyn fmt::Write {
        &mut self.writer
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::fmt::format::DefaultFields;
    use tracing_subscriber::fmt::FormatFields;

    /// A layer that formats each event's fields with both formatters.
    struct Both(std::sync::Arc<parking_lot::Mutex<Vec<(String, String)>>>);

    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Both {
        fn on_event(
            &self,
            event: &tracing::Event<'_>,
            _: tracing_subscriber::layer::Context<'_, S>,
        ) {
            let (mut ours, mut theirs) = (String::new(), String::new());
            PlainFields
                .format_fields(Writer::new(&mut ours), event)
                .unwrap();
            DefaultFields::new()
                .format_fields(Writer::new(&mut theirs), event)
                .unwrap();
            self.0.lock().push((ours, theirs));
        }
    }

    /// The sample events (every kind of field the balancer logs, and awkward ones)
    /// come out as the default formatter (without colour) writes them.
    #[test]
    fn fields_read_as_the_default_formatter_writes_them() {
        use tracing_subscriber::layer::SubscriberExt;
        let seen = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
        let subscriber = tracing_subscriber::registry().with(Both(seen.clone()));
        tracing::subscriber::with_default(subscriber, super::super::log_samples::emit);
        let seen = seen.lock();
        assert_eq!(seen.len(), super::super::log_samples::EVENTS);
        for (ours, theirs) in seen.iter() {
            assert_eq!(ours, theirs);
        }
        assert_eq!(
            seen[0].0,
            "request pool=\"mock\" node=\"n0\" route=spill:2 attempts=1 status=200 \
             ttft_ms=4 duration_ms=18446744073709551615 delta=-42 \
             least=-9223372036854775808 zero=0 ok=true"
        );
    }
}
