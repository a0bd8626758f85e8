//! A number's decimal digits without `core::fmt` (a tenth of its instructions), for
//! the text written on every request: message heads and log lines.

/// The decimal digits of `n`, written into `buf`.
pub fn digits(mut n: u64, buf: &mut [u8; 20]) -> &str {
    let mut at = buf.len();
    loop {
        at -= 1;
        buf[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    // Only ASCII digits were written.
    std::str::from_utf8(&buf[at..]).unwrap_or("0")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digits_read_as_the_formatter_writes_them() {
        for n in [0, 1, 9, 10, 99, 100, 1_000_007, u64::MAX - 1, u64::MAX] {
            assert_eq!(digits(n, &mut [0; 20]), n.to_string());
        }
    }
}
