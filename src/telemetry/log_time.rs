//! The log line's timestamp: the text of `tracing_subscriber`'s `SystemTime`
//! (`2026-12-05T06:35:54.123456Z`), with the date and time to the second kept per
//! thread and rewritten only when the second changes. The stock timer formats every
//! field of the date through `core::fmt` for each line, about 2,400 instructions at a
//! line per request; a line in the same second as the thread's last now writes the
//! kept text and its microseconds.
//! [`utc_seconds`] writes a moment to the second in the same form (RFC 3339), for the
//! times the balancer tells clients.

use std::cell::Cell;
use std::fmt;
use std::time::UNIX_EPOCH;

use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};

/// `timer` of the log.
#[derive(Debug, Clone, Copy, Default)]
pub struct SecondsKept;

/// The last second of 9999: past it the stock timer writes the year differently.
const LAST_SECOND: u64 = 253_402_300_799;

thread_local! {
    /// This thread's last second since the epoch and its text.
    static KEPT: Cell<Option<(u64, [u8; 19])>> = const { Cell::new(None) };
}

impl FormatTime for SecondsKept {
    fn format_time(&self, writer: &mut Writer<'_>) -> fmt::Result {
        let since = match std::time::SystemTime::now().duration_since(UNIX_EPOCH) {
            Ok(since) if since.as_secs() <= LAST_SECOND => since,
            // A clock before 1970 or after 9999: the stock timer's way.
            _ => return SystemTime.format_time(writer),
        };
        let seconds = since.as_secs();
        let head = match KEPT.try_with(Cell::get) {
            Ok(Some((kept, head))) if kept == seconds => head,
            _ => {
                let head = date_and_time(seconds);
                let _ = KEPT.try_with(|k| k.set(Some((seconds, head))));
                head
            }
        };
        let mut tail = *b".000000Z";
        put(&mut tail, 1, 6, u64::from(since.subsec_micros()));
        for text in [&head[..], &tail[..]] {
            writer.write_str(std::str::from_utf8(text).map_err(|_| fmt::Error)?)?;
        }
        Ok(())
    }
}

/// `YYYY-MM-DDTHH:MM:SSZ`: `seconds` since the epoch (UTC, RFC 3339), up to the end
/// of 9999 (a later moment is written as its last second).
pub fn utc_seconds(seconds: u64) -> String {
    let mut text = String::with_capacity(20);
    let date = date_and_time(seconds.min(LAST_SECOND));
    text.push_str(std::str::from_utf8(&date).unwrap_or_default());
    text.push('Z');
    text
}

/// Writes `n` as `width` decimal digits (zero-padded) at `out[at..]`.
fn put(out: &mut [u8], at: usize, width: usize, mut n: u64) {
    for i in (at..at + width).rev() {
        out[i] = b'0' + (n % 10) as u8;
        n /= 10;
    }
}

/// `YYYY-MM-DDTHH:MM:SS` (UTC) of `seconds` since the epoch, up to the end of 9999:
/// the civil date of a day count by Howard Hinnant's algorithm (`civil_from_days`).
fn date_and_time(seconds: u64) -> [u8; 19] {
    let days = seconds / 86_400;
    let of_day = seconds % 86_400;
    let z = days + 719_468;
    let era = z / 146_097;
    let day_of_era = z - era * 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let mp = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = year_of_era + era * 400 + u64::from(month <= 2);
    let mut out = *b"0000-00-00T00:00:00";
    put(&mut out, 0, 4, year);
    put(&mut out, 5, 2, month);
    put(&mut out, 8, 2, day);
    put(&mut out, 11, 2, of_day / 3_600);
    put(&mut out, 14, 2, of_day / 60 % 60);
    put(&mut out, 17, 2, of_day % 60);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_and_times_of_known_seconds() {
        // Expected texts from Python's `datetime.fromtimestamp(s, timezone.utc)`.
        for (seconds, text) in [
            (0, "1970-01-01T00:00:00"),
            (59, "1970-01-01T00:00:59"),
            (86_399, "1970-01-01T23:59:59"),
            (86_400, "1970-01-02T00:00:00"),
            (951_782_400, "2000-02-29T00:00:00"),
            (951_868_799, "2000-02-29T23:59:59"),
            (951_868_800, "2000-03-01T00:00:00"),
            (1_709_164_800, "2024-02-29T00:00:00"),
            (1_796_452_554, "2026-12-05T06:35:54"),
            (1_798_761_599, "2026-12-31T23:59:59"),
            (2_147_483_647, "2038-01-19T03:14:07"),
            (4_102_444_800, "2100-01-01T00:00:00"),
            (4_107_542_400, "2100-03-01T00:00:00"),
            (LAST_SECOND, "9999-12-31T23:59:59"),
        ] {
            assert_eq!(
                std::str::from_utf8(&date_and_time(seconds)).unwrap(),
                text,
                "{seconds}"
            );
        }
    }

    #[test]
    fn moments_to_the_second() {
        assert_eq!(utc_seconds(1_796_452_554), "2026-12-05T06:35:54Z");
        assert_eq!(utc_seconds(u64::MAX), "9999-12-31T23:59:59Z");
    }

    /// The same text as the stock timer, read at the same moment (again if a second
    /// turned between the two readings), twice so the kept second is used.
    #[test]
    fn reads_as_the_stock_timer_writes() {
        for _ in 0..2 {
            let read = |timer: &dyn FormatTime| {
                let mut text = String::new();
                timer.format_time(&mut Writer::new(&mut text)).unwrap();
                text
            };
            let (mut ours, mut stock) = (read(&SecondsKept), read(&SystemTime));
            for _ in 0..5 {
                if ours[..19] == stock[..19] {
                    break;
                }
                (ours, stock) = (read(&SecondsKept), read(&SystemTime));
            }
            assert_eq!(ours.len(), stock.len(), "{ours} {stock}");
            assert_eq!(&ours[..20], &stock[..20], "{ours} {stock}");
            assert!(ours.ends_with('Z') && ours.as_bytes()[19] == b'.', "{ours}");
            assert!(ours[20..26].bytes().all(|b| b.is_ascii_digit()), "{ours}");
        }
    }
}
