//! A borrowing JSON scanner for the routing hot path. It walks a request body once,
//! checking its structure, and hands out the raw text of the values routing reads;
//! everything else is skipped without being decoded. Strings are skipped by classifying
//! 64 bytes at a time (quotes and backslashes, with SIMD compares from the `wide`
//! crate, safe code), which is what makes an 18 KB chat body cost a few microseconds
//! instead of a full parse. Pure: no I/O, no allocation while skipping.
//!
//! Checked here: UTF-8, the syntax of objects, arrays, numbers and literals, string
//! termination, nesting depth. Not checked in strings that routing does not decode:
//! escape sequences and raw control characters; the engine that parses the body
//! reports those.

use std::borrow::Cow;
use std::fmt;

use wide::{u8x16, u8x32};

/// Deepest nesting accepted (tool schemas nest a handful of levels).
const MAX_DEPTH: usize = 128;

/// An error at a byte offset: the text's syntax, or a field's type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScanError {
    pub msg: &'static str,
    pub line: usize,
    pub column: usize,
}

impl fmt::Display for ScanError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} at line {} column {}",
            self.msg, self.line, self.column
        )
    }
}

impl std::error::Error for ScanError {}

/// A cursor over one JSON text.
pub struct Scanner<'a> {
    text: &'a str,
    pos: usize,
    depth: usize,
    /// An object key `cache_control` was passed (see [`Scanner::take_cache_marks`]).
    cache_marks: bool,
}

impl<'a> Scanner<'a> {
    pub fn new(text: &'a str) -> Self {
        Scanner {
            text,
            pos: 0,
            depth: 0,
            cache_marks: false,
        }
    }

    /// Whether an object member named `cache_control` was passed since the last call
    /// (Anthropic's cache markers, which the key leaves out): noticed as keys are read,
    /// so a body without one costs no search.
    pub fn take_cache_marks(&mut self) -> bool {
        std::mem::take(&mut self.cache_marks)
    }

    /// The byte offset reached (after any value just read).
    pub fn offset(&self) -> usize {
        self.pos
    }

    fn bytes(&self) -> &'a [u8] {
        self.text.as_bytes()
    }

    /// An error at the current position.
    #[cold]
    #[inline(never)]
    pub fn error(&self, msg: &'static str) -> ScanError {
        let before = &self.text.as_bytes()[..self.pos.min(self.text.len())];
        let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
        let line_start = before
            .iter()
            .rposition(|&b| b == b'\n')
            .map_or(0, |i| i + 1);
        ScanError {
            msg,
            line,
            column: self.pos - line_start + 1,
        }
    }

    #[inline(always)]
    fn skip_ws(&mut self) {
        let b = self.bytes();
        // Compact JSON has none: one compare settles the usual case.
        if b.get(self.pos).is_some_and(|&c| c > b' ') {
            return;
        }
        while self.pos < b.len() && matches!(b[self.pos], b' ' | b'\t' | b'\n' | b'\r') {
            self.pos += 1;
        }
    }

    /// The next non-whitespace byte, not consumed.
    pub fn peek(&mut self) -> Option<u8> {
        self.skip_ws();
        self.bytes().get(self.pos).copied()
    }

    fn expect(&mut self, byte: u8, msg: &'static str) -> Result<(), ScanError> {
        if self.peek() == Some(byte) {
            self.pos += 1;
            Ok(())
        } else {
            Err(self.error(msg))
        }
    }

    /// Requires that only whitespace remains.
    pub fn end(&mut self) -> Result<(), ScanError> {
        match self.peek() {
            None => Ok(()),
            Some(_) => Err(self.error("trailing characters")),
        }
    }

    /// Iterates an object's members; `member` gets each key (decoded) and must consume
    /// the value.
    pub fn object(
        &mut self,
        mut member: impl FnMut(&mut Self, Cow<'a, str>) -> Result<(), ScanError>,
    ) -> Result<(), ScanError> {
        self.expect(b'{', "expected an object")?;
        self.enter()?;
        if self.peek() == Some(b'}') {
            self.pos += 1;
            self.depth -= 1;
            return Ok(());
        }
        loop {
            if self.peek() != Some(b'"') {
                return Err(self.error("expected a string key"));
            }
            let key = self.string()?;
            self.cache_marks |= key == "cache_control";
            self.expect(b':', "expected ':'")?;
            member(self, key)?;
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b'}') => {
                    self.pos += 1;
                    self.depth -= 1;
                    return Ok(());
                }
                _ => return Err(self.error("expected ',' or '}'")),
            }
        }
    }

    /// Iterates an array's elements; `element` must consume each one.
    pub fn array(
        &mut self,
        mut element: impl FnMut(&mut Self) -> Result<(), ScanError>,
    ) -> Result<(), ScanError> {
        self.expect(b'[', "expected an array")?;
        self.enter()?;
        if self.peek() == Some(b']') {
            self.pos += 1;
            self.depth -= 1;
            return Ok(());
        }
        loop {
            element(self)?;
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b']') => {
                    self.pos += 1;
                    self.depth -= 1;
                    return Ok(());
                }
                _ => return Err(self.error("expected ',' or ']'")),
            }
        }
    }

    fn enter(&mut self) -> Result<(), ScanError> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(self.error("nesting too deep"));
        }
        Ok(())
    }

    /// A string literal, quotes included, not decoded.
    pub fn raw_string(&mut self) -> Result<&'a str, ScanError> {
        self.literal_string().map(|(lit, _)| lit)
    }

    /// A string, decoded.
    fn string(&mut self) -> Result<Cow<'a, str>, ScanError> {
        if let Some(plain) = self.short_plain_string() {
            return Ok(Cow::Borrowed(plain));
        }
        match self.literal_string()? {
            (lit, Escapes::None) => Ok(Cow::Borrowed(&lit[1..lit.len() - 1])),
            (lit, Escapes::Maybe) => Ok(decode(lit)),
        }
    }

    /// A key or a role: a string at the cursor whose closing quote is in its first 16
    /// bytes with no backslash before it, settled by one 16-byte compare without the
    /// general path's setup (a chat body has a hundred of them; the last key of a body,
    /// `"stream": true}`, has fewer than 16 bytes after it and is settled the same);
    /// `None` leaves the cursor at the value (past any whitespace) for the general path.
    #[inline(always)]
    fn short_plain_string(&mut self) -> Option<&'a str> {
        self.skip_ws();
        let start = self.pos + 1;
        let b = self.bytes();
        if b.get(self.pos) != Some(&b'"') {
            return None;
        }
        let window = lane_at(b, start);
        let (quotes, backslashes) = (lane_mask(&window, b'"'), lane_mask(&window, b'\\'));
        if quotes == 0 || quotes.trailing_zeros() > backslashes.trailing_zeros() {
            return None;
        }
        let end = start + quotes.trailing_zeros() as usize;
        let plain = self.text.get(start..end)?;
        self.pos = end + 1;
        Some(plain)
    }

    /// A string literal, quotes included, and whether it may hold escapes. Inlined:
    /// called, its `Result` came back through memory, written 8 bytes at a time and
    /// read back 16 at a time, which stalled the CPU's store forwarding once a message
    /// (docs/performance.md, "An eighteenth sitting").
    #[inline(always)]
    fn literal_string(&mut self) -> Result<(&'a str, Escapes), ScanError> {
        self.expect(b'"', "expected a string")?;
        let start = self.pos - 1;
        match closing_quote(self.bytes(), self.pos) {
            Some((at, escapes)) => {
                self.pos = at + 1;
                Ok((&self.text[start..self.pos], escapes))
            }
            None => {
                self.pos = self.text.len();
                Err(self.error("unterminated string"))
            }
        }
    }

    /// An object whose members are all named in `names`, each with a string value,
    /// and each name a short plain string (a chat message's `{"role": …, "content":
    /// …}`): each name's value (the last, if one repeats), and the cursor after the
    /// object. Anything else (another member, another kind of value, a syntax error)
    /// reads nothing and returns `None`, for [`Scanner::object`] to read (or reject) in
    /// full. A usual message costs a fraction of the general path: no decoded names,
    /// no callbacks, no errors built.
    pub fn string_members<const N: usize>(
        &mut self,
        names: [&str; N],
    ) -> Option<[Option<StringValue<'a>>; N]> {
        let start = self.pos;
        let found = self.try_string_members(names);
        if found.is_none() {
            self.pos = start;
        }
        found
    }

    #[inline(always)]
    fn try_string_members<const N: usize>(
        &mut self,
        names: [&str; N],
    ) -> Option<[Option<StringValue<'a>>; N]> {
        if self.peek() != Some(b'{') || self.depth >= MAX_DEPTH {
            return None;
        }
        self.pos += 1;
        let mut values = [None; N];
        if self.peek() == Some(b'}') {
            self.pos += 1;
            return Some(values);
        }
        loop {
            let name = self.short_plain_string()?;
            let slot = names.iter().position(|n| *n == name)?;
            if self.peek() != Some(b':') {
                return None;
            }
            self.pos += 1;
            if self.peek() != Some(b'"') {
                return None;
            }
            let (literal, escapes) = self.literal_string().ok()?;
            values[slot] = Some(StringValue { literal, escapes });
            match self.peek() {
                Some(b',') => self.pos += 1,
                Some(b'}') => {
                    self.pos += 1;
                    return Some(values);
                }
                _ => return None,
            }
        }
    }

    /// A string (decoded) or `null`.
    pub fn opt_string(&mut self, msg: &'static str) -> Result<Option<Cow<'a, str>>, ScanError> {
        match self.peek() {
            Some(b'"') => Ok(Some(self.string()?)),
            Some(b'n') => self.literal("null").map(|_| None),
            _ => Err(self.error(msg)),
        }
    }

    /// `true`, `false` or `null`.
    pub fn opt_bool(&mut self, msg: &'static str) -> Result<Option<bool>, ScanError> {
        match self.peek() {
            Some(b't') => self.literal("true").map(|_| Some(true)),
            Some(b'f') => self.literal("false").map(|_| Some(false)),
            Some(b'n') => self.literal("null").map(|_| None),
            _ => Err(self.error(msg)),
        }
    }

    fn literal(&mut self, word: &'static str) -> Result<(), ScanError> {
        if self.text[self.pos..].starts_with(word) {
            self.pos += word.len();
            Ok(())
        } else {
            Err(self.error("invalid literal"))
        }
    }

    fn number(&mut self) -> Result<(), ScanError> {
        let b = self.bytes();
        let start = self.pos;
        if b.get(self.pos) == Some(&b'-') {
            self.pos += 1;
        }
        let digits = |s: &mut Self| {
            let from = s.pos;
            while s.pos < b.len() && b[s.pos].is_ascii_digit() {
                s.pos += 1;
            }
            s.pos > from
        };
        if !digits(self) {
            return Err(self.error("invalid number"));
        }
        if b[start..self.pos].starts_with(b"0") && self.pos - start > 1
            || b[start..self.pos].starts_with(b"-0") && self.pos - start > 2
        {
            return Err(self.error("invalid number (leading zero)"));
        }
        if b.get(self.pos) == Some(&b'.') {
            self.pos += 1;
            if !digits(self) {
                return Err(self.error("invalid number"));
            }
        }
        if matches!(b.get(self.pos), Some(b'e' | b'E')) {
            self.pos += 1;
            if matches!(b.get(self.pos), Some(b'+' | b'-')) {
                self.pos += 1;
            }
            if !digits(self) {
                return Err(self.error("invalid number"));
            }
        }
        Ok(())
    }

    /// Skips any value; returns its raw text.
    pub fn value(&mut self) -> Result<&'a str, ScanError> {
        let start = match self.peek() {
            Some(_) => self.pos,
            None => return Err(self.error("expected a value")),
        };
        match self.bytes()[start] {
            b'"' => {
                self.raw_string()?;
            }
            b'{' => self.object(|s, _| s.value().map(|_| ()))?,
            b'[' => self.array(|s| s.value().map(|_| ()))?,
            b't' => self.literal("true")?,
            b'f' => self.literal("false")?,
            b'n' => self.literal("null")?,
            b'-' | b'0'..=b'9' => self.number()?,
            _ => return Err(self.error("expected a value")),
        }
        Ok(&self.text[start..self.pos])
    }
}

/// The index of the quote that closes a string whose contents start at `from`, and
/// whether the string may hold escapes.
///
/// Short strings (keys, roles) are settled by one 16-byte compare. Prompts are dense with escaped quotes (code, JSON, dialogue), so instead of
/// stopping at every quote this classifies 64 bytes at a time with SIMD compares
/// (`wide`, safe code): a quote with no backslash before it closes the string; one
/// with a single backslash before it is escaped; only a quote after two or more
/// backslashes needs the run counted.
fn closing_quote(b: &[u8], from: usize) -> Option<(usize, Escapes)> {
    let rest = b.get(from..)?;
    // Keys and roles are short and plain: one 16-byte compare settles them (a quote
    // with no backslash before it in the string closes it) before blocks are set up.
    let window = lane_at(b, from);
    let (quotes, backslashes) = (lane_mask(&window, b'"'), lane_mask(&window, b'\\'));
    if quotes != 0 && quotes.trailing_zeros() < backslashes.trailing_zeros() {
        return Some((from + quotes.trailing_zeros() as usize, Escapes::None));
    }
    // Whole 64-byte blocks (fixed-size arrays: no bounds checks in the loop), then the
    // last partial one padded with zeros (neither quote nor backslash).
    let blocks = rest.chunks_exact(64);
    let partial = blocks.remainder();
    let whole = blocks.len();
    for (n, block) in blocks
        .filter_map(|c| <&[u8; 64]>::try_from(c).ok())
        .enumerate()
    {
        // Most blocks of prose hold no quote: one folded compare settles them.
        if holds(block, b'"') {
            if let Some(found) = block_quote(b, from, 64 * n, block, mask(block, b'"')) {
                return Some(found);
            }
        }
    }
    let mut padded = [0u8; 64];
    padded[..partial.len()].copy_from_slice(partial);
    block_quote(b, from, 64 * whole, &padded, mask(&padded, b'"'))
}

/// The closing quote in one 64-byte block of a string whose contents start at `from`
/// (the block starts `offset` bytes in), if the block holds it; `quotes` is the
/// block's quote mask.
#[inline(always)]
fn block_quote(
    b: &[u8],
    from: usize,
    offset: usize,
    block: &[u8; 64],
    quotes: u64,
) -> Option<(usize, Escapes)> {
    if quotes == 0 {
        return None;
    }
    // The two bytes before the block, if they are the string's, as bits 62 and 63.
    let before = |back: usize| offset >= back && b[from + offset - back] == b'\\';
    let prev_backslashes = u64::from(before(2)) << 62 | u64::from(before(1)) << 63;
    let backslashes = mask(block, b'\\');
    let after_one = backslashes << 1 | prev_backslashes >> 63;
    let after_two = backslashes << 2 | prev_backslashes >> 62;
    let mut candidates = quotes & !(after_one & !after_two);
    while candidates != 0 {
        let at = from + offset + candidates.trailing_zeros() as usize;
        let run = b[from..at]
            .iter()
            .rev()
            .take_while(|&&c| c == b'\\')
            .count();
        if run % 2 == 0 {
            return Some((at, Escapes::Maybe));
        }
        candidates &= candidates - 1;
    }
    None
}

/// A string value as [`Scanner::string_members`] read it: its literal, and whether
/// the literal may hold escapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StringValue<'a> {
    literal: &'a str,
    escapes: Escapes,
}

impl<'a> StringValue<'a> {
    /// The literal, quotes included, not decoded.
    pub fn literal(self) -> &'a str {
        self.literal
    }

    /// The value, decoded (borrowed when it holds no escapes, as most do).
    pub fn decoded(self) -> Cow<'a, str> {
        match self.escapes {
            Escapes::None => Cow::Borrowed(&self.literal[1..self.literal.len() - 1]),
            Escapes::Maybe => decode(self.literal),
        }
    }
}

/// Whether a string literal may hold escapes (`None`: known to hold none, so its text
/// is its value).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Escapes {
    None,
    Maybe,
}

/// The bit mask of the bytes of a 64-byte block that equal `byte`: two 32-byte
/// compares, each one AVX2 instruction in a build for a CPU that has it (`-C
/// target-cpu=x86-64-v3` or `native`) and two SSE2 ones otherwise.
fn mask(block: &[u8; 64], byte: u8) -> u64 {
    halves(block).enumerate().fold(0, |bits, (k, half)| {
        bits | u64::from(half_mask(half, byte)) << (32 * k)
    })
}

/// Whether a 64-byte block holds `byte`: four 16-byte compares folded into one mask,
/// cheaper than [`mask`] for the blocks of prose that hold no quote.
#[inline(always)]
fn holds(block: &[u8; 64], byte: u8) -> bool {
    let splat = u8x16::splat(byte);
    block
        .chunks_exact(16)
        .filter_map(|lane| <[u8; 16]>::try_from(lane).ok())
        .fold(u8x16::splat(0), |any, lane| {
            any | u8x16::new(lane).simd_eq(splat)
        })
        .to_bitmask()
        != 0
}

/// A block's two 32-byte halves (the conversions cannot fail, and compile away).
#[inline(always)]
fn halves(block: &[u8; 64]) -> impl Iterator<Item = &[u8; 32]> {
    block
        .chunks_exact(32)
        .filter_map(|half| half.try_into().ok())
}

/// The bit mask of the bytes of a 32-byte half block that equal `byte`.
#[inline(always)]
fn half_mask(half: &[u8; 32], byte: u8) -> u32 {
    u8x32::new(*half).simd_eq(u8x32::splat(byte)).to_bitmask()
}

/// The 16 bytes of `b` from `start`, padded with zeros (neither quote nor backslash)
/// past its end.
#[inline(always)]
fn lane_at(b: &[u8], start: usize) -> [u8; 16] {
    match b.get(start..).and_then(|rest| rest.first_chunk::<16>()) {
        Some(whole) => *whole,
        None => {
            let rest = b.get(start..).unwrap_or_default();
            let mut lane = [0u8; 16];
            lane[..rest.len()].copy_from_slice(rest);
            lane
        }
    }
}

/// The bit mask of the bytes of a 16-byte lane that equal `byte`.
fn lane_mask(lane: &[u8; 16], byte: u8) -> u16 {
    u8x16::new(*lane).simd_eq(u8x16::splat(byte)).to_bitmask() as u16
}

/// Decodes a whole string literal (quotes included).
pub fn decode(lit: &str) -> Cow<'_, str> {
    let inner = &lit[1..lit.len() - 1];
    if !inner.contains('\\') {
        return Cow::Borrowed(inner);
    }
    let mut out = String::with_capacity(inner.len());
    decode_prefix(lit, usize::MAX, &mut out);
    Cow::Owned(out)
}

/// Decodes a string literal (quotes included) into `out`, stopping after `max_chars`
/// characters; returns how many were written. Bad escapes and lone surrogates become
/// U+FFFD; text is never cut inside a code point.
pub fn decode_prefix(lit: &str, max_chars: usize, out: &mut String) -> usize {
    let mut rest = lit.get(1..lit.len().saturating_sub(1)).unwrap_or("");
    let mut written = 0;
    while !rest.is_empty() && written < max_chars {
        let plain = memchr::memchr(b'\\', rest.as_bytes()).unwrap_or(rest.len());
        if plain > 0 {
            let (taken, n) = take_chars(&rest[..plain], max_chars - written);
            out.push_str(taken);
            written += n;
            rest = &rest[taken.len()..];
            continue;
        }
        let (c, used) = unescape(rest);
        out.push(c);
        written += 1;
        rest = &rest[used.min(rest.len())..];
    }
    written
}

/// The first `n` chars of `s` (or all of it) and their count.
pub fn take_chars(s: &str, n: usize) -> (&str, usize) {
    if s.is_ascii() {
        let k = s.len().min(n);
        return (&s[..k], k);
    }
    if s.len() <= n {
        // Fewer bytes than the budget: certainly fewer chars; count them.
        return (s, s.chars().count());
    }
    match s.char_indices().nth(n) {
        Some((cut, _)) => (&s[..cut], n),
        None => (s, s.chars().count()),
    }
}

/// Decodes one escape at the start of `s` (which starts with `\`): the char and the
/// bytes used.
fn unescape(s: &str) -> (char, usize) {
    let b = s.as_bytes();
    match b.get(1) {
        Some(b'n') => ('\n', 2),
        Some(b't') => ('\t', 2),
        Some(b'r') => ('\r', 2),
        Some(b'b') => ('\u{8}', 2),
        Some(b'f') => ('\u{c}', 2),
        Some(b'u') => {
            let hex = |at: usize| {
                s.get(at..at + 4)
                    .and_then(|h| u32::from_str_radix(h, 16).ok())
            };
            let Some(hi) = hex(2) else {
                return ('\u{fffd}', 2);
            };
            if (0xD800..0xDC00).contains(&hi) && s.get(6..8) == Some("\\u") {
                if let Some(lo) = hex(8).filter(|lo| (0xDC00..0xE000).contains(lo)) {
                    let c = 0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00);
                    return (char::from_u32(c).unwrap_or('\u{fffd}'), 12);
                }
            }
            (char::from_u32(hi).unwrap_or('\u{fffd}'), 6)
        }
        Some(&c) if c.is_ascii() => (c as char, 2),
        _ => ('\u{fffd}', 1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn skim(text: &str) -> Result<&str, ScanError> {
        let mut s = Scanner::new(text);
        let v = s.value()?;
        s.end()?;
        Ok(v)
    }

    #[test]
    fn accepts_valid_json() {
        for ok in [
            r#"{"a": [1, -2.5e+3, true, false, null, {"b": "c\"d\\"}], "e": {}}"#,
            "[]",
            " 0 ",
            r#""\u00e9\ud83c\udf89""#,
            "[[[[[]]]]]",
        ] {
            assert!(skim(ok).is_ok(), "{ok}: {:?}", skim(ok));
        }
    }

    #[test]
    fn rejects_broken_structure() {
        for bad in [
            "{",
            "[1,]",
            "{\"a\" 1}",
            "{\"a\":1,}",
            "[1 2]",
            "tru",
            "01",
            "-",
            "1.",
            "1e",
            "\"abc",
            "{} x",
            "{1:2}",
            "",
            "[\"a\\\"]",
        ] {
            assert!(skim(bad).is_err(), "{bad:?} was accepted");
        }
        let deep = "[".repeat(200) + &"]".repeat(200);
        assert_eq!(skim(&deep).unwrap_err().msg, "nesting too deep");
    }

    #[test]
    fn errors_have_positions() {
        let e = skim("{\n  \"a\": [1,\n  }").unwrap_err();
        assert_eq!((e.line, e.column), (3, 3), "{e}");
    }

    #[test]
    fn object_members_and_decoding() {
        let mut s = Scanner::new(r#"{"k\u0031": "v\n", "skip": [1, {"x": "]"}], "b": true}"#);
        let mut seen = Vec::new();
        s.object(|s, k| {
            match &*k {
                "k1" => seen.push(format!("k1={}", s.opt_string("string")?.unwrap())),
                "b" => seen.push(format!("b={:?}", s.opt_bool("bool")?)),
                _ => seen.push(format!("{k} raw={}", s.value()?)),
            }
            Ok(())
        })
        .unwrap();
        assert_eq!(
            seen,
            vec!["k1=v\n", r#"skip raw=[1, {"x": "]"}]"#, "b=Some(true)"]
        );
    }

    /// A body's last key has fewer than 16 bytes after its opening quote, and is
    /// settled by the short compare over a zero-padded window: the padding is neither
    /// a quote nor a backslash, so an escape or a missing quote near the end still
    /// takes the general path.
    #[test]
    fn strings_near_the_end_of_the_text() {
        let keys = |text: &str| {
            let mut s = Scanner::new(text);
            let mut keys = Vec::new();
            let done = s.object(|s, k| {
                keys.push(k.into_owned());
                s.value().map(|_| ())
            });
            done.map(|()| keys)
        };
        assert_eq!(
            keys(r#"{"model": "m", "stream": true}"#).unwrap(),
            ["model", "stream"]
        );
        assert_eq!(keys(r#"{"a":1}"#).unwrap(), ["a"]);
        assert_eq!(keys(r#"{"a\"b": 1}"#).unwrap(), ["a\"b"]);
        assert_eq!(keys(r#"{"ab"#).unwrap_err().msg, "unterminated string");
        assert_eq!(keys(r#"{"a\"#).unwrap_err().msg, "unterminated string");
        assert_eq!(
            keys(r#"{"a": "b\"}"#).unwrap_err().msg,
            "unterminated string"
        );
        let mut s = Scanner::new(r#""x""#);
        assert_eq!(s.opt_string("string").unwrap().as_deref(), Some("x"));
        assert_eq!(
            Scanner::new(r#""x"#).raw_string().unwrap_err().msg,
            "unterminated string"
        );
    }

    #[test]
    fn decode_prefix_cuts_on_chars() {
        let mut out = String::new();
        assert_eq!(decode_prefix(r#""héllo\nwörld""#, 7, &mut out), 7);
        assert_eq!(out, "héllo\nw");
        let mut out = String::new();
        decode_prefix(r#""\ud800x""#, 10, &mut out);
        assert_eq!(out, "\u{fffd}x");
    }

    /// The reference: the first quote after an even run of backslashes, counted byte by
    /// byte.
    fn counted_closing_quote(b: &[u8], from: usize) -> Option<usize> {
        let mut escaped = false;
        for (at, &c) in b.iter().enumerate().skip(from) {
            match (c, escaped) {
                (_, true) => escaped = false,
                (b'\\', false) => escaped = true,
                (b'"', false) => return Some(at),
                _ => {}
            }
        }
        None
    }

    /// What the general path reads of an object: the raw value of each of `names`
    /// (the last, if one repeats), and the offset after it.
    fn general_members<const N: usize>(
        text: &str,
        names: [&str; N],
    ) -> Result<([Option<String>; N], usize), ScanError> {
        let mut s = Scanner::new(text);
        let mut values: [Option<String>; N] = std::array::from_fn(|_| None);
        s.object(|s, key| {
            let v = s.value()?;
            if let Some(i) = names.iter().position(|n| *n == key) {
                values[i] = Some(v.to_owned());
            }
            Ok(())
        })?;
        Ok((values, s.offset()))
    }

    #[test]
    fn string_members_reads_usual_messages_and_leaves_the_rest() {
        for (text, role, content) in [
            (
                r#"{"role":"user","content":"hi"}"#,
                Some(r#""user""#),
                Some(r#""hi""#),
            ),
            (
                "{ \"content\" : \"a \\\"q\\\" b\" ,\n \"role\": \"assistant\" }",
                Some(r#""assistant""#),
                Some(r#""a \"q\" b""#),
            ),
            (r#"{"role":"user","role":"tool"}"#, Some(r#""tool""#), None),
            ("{}", None, None),
        ] {
            let mut s = Scanner::new(text);
            let found = s.string_members(["role", "content"]);
            let found = found.map(|values| values.map(|v| v.map(StringValue::literal)));
            assert_eq!(found, Some([role, content]), "{text}");
            assert_eq!(s.offset(), text.len(), "{text}");
        }
        // Another member, another kind of value, an escaped name, bad syntax: nothing
        // read, for the general path (which reads or rejects it).
        for text in [
            r#"{"role":"user","name":"x"}"#,
            r#"{"role":"user","content":null}"#,
            r#"{"role":"user","content":[{"type":"text","text":"hi"}]}"#,
            r#"{"rol\u0065":"user"}"#,
            r#"{"role":"user",}"#,
            r#"{"role" "user"}"#,
            r#"{"role":"user""#,
            r#"{"content":"unterminated}"#,
            r#"["role"]"#,
        ] {
            let mut s = Scanner::new(text);
            assert_eq!(s.string_members(["role", "content"]), None, "{text}");
            assert_eq!(s.offset(), 0, "{text}");
        }
    }

    proptest! {
        /// Whatever `string_members` reads, the general path reads the same way to the
        /// same offset; what it leaves, it leaves untouched.
        #[test]
        fn string_members_agrees_with_the_general_path(
            members in prop::collection::vec(
                (
                    prop::sample::select(vec!["role", "content", "name", "rol\\u0065"]),
                    prop::sample::select(vec![
                        r#""user""#, r#""""#, r#""a \"b\" \\""#, r#""\\""#, "null", "1",
                        "[]", r#"{"x":"y"}"#, r#""unterminated"#, "tru",
                    ]),
                    "[ \n]{0,2}",
                ),
                0..4,
            ),
            cut in prop::option::weighted(0.2, 1usize..8),
            trailing_comma in prop::bool::weighted(0.1),
        ) {
            let mut text = String::from("{");
            for (i, (name, value, ws)) in members.iter().enumerate() {
                if i > 0 {
                    text.push(',');
                }
                text.push_str(&format!("{ws}\"{name}\"{ws}:{ws}{value}{ws}"));
            }
            if trailing_comma {
                text.push(',');
            }
            text.push('}');
            let text = &text[..text.len().saturating_sub(cut.unwrap_or(0))];
            let mut s = Scanner::new(text);
            match s.string_members(["role", "content"]) {
                Some(found) => {
                    let (values, end) = general_members(text, ["role", "content"])
                        .map_err(|e| TestCaseError::fail(format!("{text:?}: {e}")))?;
                    let literals = found.map(|v| v.map(|v| v.literal().to_owned()));
                    prop_assert_eq!(literals, values, "{:?}", text);
                    // Decoded, each is what the general path decodes.
                    for v in found.into_iter().flatten() {
                        prop_assert_eq!(v.decoded(), decode(v.literal()));
                    }
                    prop_assert_eq!(s.offset(), end, "{:?}", text);
                }
                None => prop_assert_eq!(s.offset(), 0, "{:?}", text),
            }
        }
    }

    proptest! {
        #[test]
        fn agrees_with_serde_on_valid_json(v in arb_json()) {
            let text = serde_json::to_string_pretty(&v).unwrap();
            prop_assert_eq!(skim(&text), Ok(text.as_str()));
            if let serde_json::Value::String(s) = &v {
                let lit = serde_json::to_string(&v).unwrap();
                prop_assert_eq!(decode(&lit), s.as_str());
            }
        }

        #[test]
        fn closing_quote_agrees_with_counting_backslashes(
            text in "[ab\"\\\\]{0,40}|[a \"\\\\]{60,300}",
            from in 0usize..8,
        ) {
            let b = text.as_bytes();
            let from = from.min(b.len());
            let expected = counted_closing_quote(b, from);
            let found = closing_quote(b, from);
            prop_assert_eq!(found.map(|(at, _)| at), expected, "{:?} from {}", text, from);
            // "No escapes" is said only of strings that hold no backslash.
            if let (Some((at, Escapes::None)), Some(_)) = (found, expected) {
                prop_assert!(!b[from..at].contains(&b'\\'), "{:?} from {}", text, from);
            }
        }

        /// Quotes after runs of backslashes that straddle the edges of the 64-byte
        /// blocks (the runs the block's carried bits must get right).
        #[test]
        fn closing_quote_after_backslashes_at_a_block_edge(
            plain in 0usize..200,
            run in 0usize..6,
            after in "[a\"\\\\]{0,8}",
            from in 0usize..3,
        ) {
            let text = format!("{}{}\"{after}", "a".repeat(plain), "\\".repeat(run));
            let b = text.as_bytes();
            prop_assert_eq!(
                closing_quote(b, from).map(|(at, _)| at),
                counted_closing_quote(b, from),
                "{:?} from {}", text, from
            );
        }

        /// Keys and string values decode as serde reads them, whatever their length
        /// around the short strings' 16-byte window and wherever a quote or backslash
        /// sits in it, and the cursor lands just after each (the body may end there).
        #[test]
        fn keys_and_strings_decode_as_serde_reads_them(
            members in prop::collection::vec(("[a\"\\\\é ]{0,20}", "[a\"\\\\\n]{0,20}"), 1..5),
        ) {
            let map: serde_json::Map<String, serde_json::Value> = members
                .into_iter()
                .map(|(k, v)| (k, serde_json::Value::String(v)))
                .collect();
            let text = serde_json::to_string(&map).unwrap();
            let mut s = Scanner::new(&text);
            let mut seen = Vec::new();
            s.object(|s, k| {
                let v = s.opt_string("a string")?.unwrap_or_default();
                seen.push((k.into_owned(), v.into_owned()));
                Ok(())
            })
            .unwrap();
            prop_assert!(s.end().is_ok(), "{}", text);
            let expected: Vec<(String, String)> = map
                .into_iter()
                .map(|(k, v)| (k, v.as_str().unwrap_or_default().to_string()))
                .collect();
            prop_assert_eq!(seen, expected, "{}", text);
        }

        #[test]
        fn never_panics(text in "\\PC{0,60}") {
            let _ = skim(&text);
        }

        #[test]
        fn rejects_what_serde_rejects_structurally(text in "[\\[\\]{}:,\"a0-9 tfn.e-]{0,24}") {
            // Any text we accept, serde parses too (string contents here need no escapes).
            if skim(&text).is_ok() {
                prop_assert!(serde_json::from_str::<serde_json::Value>(&text).is_ok(), "{text}");
            }
        }
    }

    fn arb_json() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::Bool),
            any::<i64>().prop_map(|n| serde_json::json!(n)),
            (-1e9f64..1e9).prop_map(|n| serde_json::json!(n)),
            "\\PC{0,20}".prop_map(serde_json::Value::String),
            "[\"\\\\\\n\\t\\u{1}]{0,8}".prop_map(serde_json::Value::String),
        ];
        leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::Array),
                prop::collection::btree_map("\\PC{0,6}", inner, 0..6)
                    .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }
}
