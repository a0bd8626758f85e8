//! Durations as the config writes them: `"250ms"`, `"30s"`, `"1.5s"`, `"2m"`, `"1h"`,
//! `"100us"`, bounded by [`MAX_DURATION`].

use std::time::Duration;

use serde::{Deserialize, Deserializer};

/// A duration written as a string: `"250ms"`, `"30s"`, `"1.5s"`, `"2m"`, `"1h"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dur(pub Duration);

impl Dur {
    pub(super) const fn secs(s: u64) -> Dur {
        Dur(Duration::from_secs(s))
    }
}

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        parse_duration(&s)
            .map(Dur)
            .map_err(serde::de::Error::custom)
    }
}

/// The longest duration any setting takes: far beyond any sensible timeout, and far
/// from the point where adding it to a clock reading would overflow.
pub const MAX_DURATION: Duration = Duration::from_secs(7 * 24 * 3600);

/// Parses `"250ms"`, `"30s"`, `"1.5s"`, `"2m"`, `"1h"`, `"100us"` (at most
/// [`MAX_DURATION`]).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .ok_or_else(|| format!("duration {s:?} has no unit (use e.g. \"30s\" or \"250ms\")"))?;
    let (num, unit) = s.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("duration {s:?} does not start with a number"))?;
    let secs = match unit {
        "us" | "µs" => value / 1e6,
        "ms" => value / 1e3,
        "s" => value,
        "m" => value * 60.0,
        "h" => value * 3600.0,
        _ => {
            return Err(format!(
                "duration {s:?} has unknown unit {unit:?} (use us, ms, s, m or h)"
            ))
        }
    };
    match Duration::try_from_secs_f64(secs) {
        Ok(d) if d <= MAX_DURATION => Ok(d),
        _ => Err(format!("duration {s:?} is longer than the limit of 7 days")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert!(parse_duration("10").is_err());
        assert!(parse_duration("s").is_err());
    }
}
