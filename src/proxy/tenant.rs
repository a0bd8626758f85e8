//! Who a request is: its tenant (its API key's name, else `routing.tenant_header`,
//! else `default`), its priority class (its tenant's, or a lower one it asks for by
//! `routing.priority_header`), how long it may wait in the queue (`queue_timeout`, or
//! less by `x-request-timeout`), and the per-tenant rate limits (token buckets of
//! requests and tokens per minute, charged at admission). Pure but for the buckets'
//! lock.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use http::{HeaderMap, HeaderName};
use parking_lot::Mutex;

use crate::config::{Tenancy, TenantConfig};
use crate::routing::facts::Api;
use crate::telemetry::log_time::utc_seconds;

/// The header by which a client bounds its wait in the queue (seconds, or a duration
/// such as `"2500ms"`); it can shorten `routing.queue_timeout`, never lengthen it.
pub static REQUEST_TIMEOUT: HeaderName = HeaderName::from_static("x-request-timeout");

/// Longest tenant name taken from a header.
const MAX_TENANT_CHARS: usize = 64;

/// The name in the TLS certificate a client showed (its subject's common name, else
/// its first DNS name, else its first URI, such as a SPIFFE ID), on each request of
/// its connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertifiedName(pub Arc<str>);

/// What names the caller beside its headers: its API key's name, and the name in its
/// client certificate.
#[derive(Debug, Clone, Copy, Default)]
pub struct Caller<'a> {
    pub key_name: Option<&'a str>,
    pub certified: Option<&'a CertifiedName>,
}

/// A request's tenant and class.
#[derive(Debug, Clone)]
pub struct Identity {
    pub tenant: Arc<str>,
    pub class: usize,
    pub config: TenantConfig,
    /// The tenant is named in the config (`[[tenants]]` or a key's name): its own
    /// metric label; any other is counted as `other`.
    pub known: bool,
}

impl Identity {
    /// The tenant as a metric label (bounded: configured names, or `other`).
    pub fn label(&self) -> &str {
        label(&self.tenant, self.known)
    }
}

/// A tenant's metric label: its name when the config names it, else `other`.
pub fn label(tenant: &str, known: bool) -> &str {
    if known {
        tenant
    } else {
        "other"
    }
}

/// Who a request is: its API key's name, else (with
/// `routing.tenant_from_client_certificate`) the name in its client certificate, else
/// `routing.tenant_header`'s value, else `default`.
pub fn identify(tenancy: &Tenancy, caller: Caller<'_>, headers: &HeaderMap) -> Identity {
    let key_name = caller.key_name;
    let certified = caller
        .certified
        .filter(|_| tenancy.tenant_from_certificate)
        .map(|c| &*c.0);
    let from_header = || {
        let h = tenancy.tenant_header.as_ref()?;
        let v = headers.get(h)?.to_str().ok()?.trim();
        let ok =
            !v.is_empty() && v.len() <= MAX_TENANT_CHARS && v.bytes().all(|b| b.is_ascii_graphic());
        ok.then_some(v)
    };
    let named = key_name.or(certified).or_else(from_header);
    let tenant = named.unwrap_or("default");
    let config = tenancy.tenant(tenant);
    let known = key_name.is_some() || tenancy.tenants.contains_key(tenant) || named.is_none();
    // A request may ask for a class at or below its tenant's, never above.
    let asked = tenancy
        .priority_header
        .as_ref()
        .and_then(|h| headers.get(h)?.to_str().ok())
        .and_then(|name| tenancy.class(name.trim()));
    let class = asked.map_or(config.class, |c| c.max(config.class));
    Identity {
        // The common case, no name: shared, not allocated.
        tenant: named.map_or_else(|| tenancy.default_tenant.clone(), Arc::from),
        class,
        config,
        known,
    }
}

/// How long a request may wait in the queue: `queue_timeout`, or less when its client
/// says so.
pub fn queue_deadline(headers: &HeaderMap, queue_timeout: Duration) -> Duration {
    let asked = headers
        .get(&REQUEST_TIMEOUT)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let v = v.trim();
            match v.parse::<f64>() {
                Ok(secs) if secs.is_finite() && secs >= 0.0 => {
                    Some(Duration::from_secs_f64(secs.min(1e6)))
                }
                Ok(_) => None,
                Err(_) => crate::config::parse_duration(v).ok(),
            }
        });
    asked.map_or(queue_timeout, |a| a.min(queue_timeout))
}

/// Which limit a request went over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    Requests,
    Tokens,
}

impl Limit {
    pub fn as_str(self) -> &'static str {
        match self {
            Limit::Requests => "requests_per_minute",
            Limit::Tokens => "tokens_per_minute",
        }
    }
}

/// A request over its tenant's rate: which limit, how long until it would pass, and
/// what is left (told in the 429's rate-limit headers, as the APIs' own 429s do).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    pub limit: Limit,
    pub wait: Duration,
    pub standing: Standing,
}

/// One bucket: what is left of a per-minute allowance, refilled continuously. It may
/// go below zero (a request larger than what is left passes while anything is left,
/// and the debt is paid before the next).
#[derive(Debug, Clone, Copy)]
struct Bucket {
    level: f64,
    at: Instant,
}

impl Bucket {
    fn full(per_minute: u64, now: Instant) -> Bucket {
        Bucket {
            level: per_minute as f64,
            at: now,
        }
    }

    /// Refills for the time since the last refill. Requests charge as of their start,
    /// which can come a little out of order: an earlier `now` adds nothing.
    fn refill(&mut self, per_minute: u64, now: Instant) {
        let rate = per_minute as f64 / 60.0;
        let secs = now.saturating_duration_since(self.at).as_secs_f64();
        self.level = (self.level + secs * rate).min(per_minute as f64);
        self.at = self.at.max(now);
    }

    /// How long until it is back to zero (nothing when it is not below).
    fn wait(&self, per_minute: u64) -> Option<Duration> {
        (self.level < 0.0).then(|| Duration::from_secs_f64(-self.level * 60.0 / per_minute as f64))
    }

    /// What is left of it, and how long until it is full.
    fn left(&self, per_minute: u64) -> Left {
        let missing = (per_minute as f64 - self.level).max(0.0);
        Left {
            limit: per_minute,
            remaining: self.level.max(0.0).floor() as u64,
            reset: Duration::from_secs_f64(missing * 60.0 / per_minute.max(1) as f64),
        }
    }
}

/// What a tenant has left of one allowance once a request is charged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Left {
    /// The allowance per minute.
    pub limit: u64,
    /// What is left of it now (never below zero).
    pub remaining: u64,
    /// How long until it is whole again.
    pub reset: Duration,
}

/// What a tenant with rate limits has left once a request is charged: told to its
/// client in the rate-limit headers of its API (OpenAI's `x-ratelimit-*`, Anthropic's
/// `anthropic-ratelimit-*`), so it can pace itself.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Standing {
    pub requests: Option<Left>,
    pub tokens: Option<Left>,
}

impl Standing {
    /// Its headers in the vocabulary of the request's API: Anthropic's on the Messages
    /// API (which its SDK reads), OpenAI's on every other.
    pub fn headers_for(&self, api: Api) -> Vec<(HeaderName, http::HeaderValue)> {
        if api.is_anthropic() {
            let now = SystemTime::now().duration_since(UNIX_EPOCH);
            self.anthropic_headers(now.map_or(0, |d| d.as_secs()))
        } else {
            self.openai_headers()
        }
    }

    /// OpenAI's headers for it: `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`,
    /// the reset as a Go duration (`"1s"`, `"6m0s"`, `"17ms"`).
    pub fn openai_headers(&self) -> Vec<(HeaderName, http::HeaderValue)> {
        self.told_in([&REQUESTS, &TOKENS], go_duration)
    }

    /// Anthropic's headers for it, at `now` (seconds since the epoch):
    /// `anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}`, the reset as the
    /// moment the allowance is whole again (RFC 3339, to the second, rounded up).
    /// Anthropic's `tokens` is the most restrictive of its token limits; ours counts
    /// prompt and output tokens together, so it is that one.
    pub fn anthropic_headers(&self, now: u64) -> Vec<(HeaderName, http::HeaderValue)> {
        self.told_in(
            [&ANTHROPIC_REQUESTS, &ANTHROPIC_TOKENS],
            |reset: Duration| utc_seconds(now.saturating_add(reset.as_secs_f64().ceil() as u64)),
        )
    }

    /// Limit, remaining and reset of requests and of tokens (those it has), under
    /// `names` (of requests, of tokens), the reset written by `reset`.
    fn told_in(
        &self,
        names: [&[HeaderName; 3]; 2],
        reset: impl Fn(Duration) -> String,
    ) -> Vec<(HeaderName, http::HeaderValue)> {
        let mut out = Vec::with_capacity(6);
        for (names, left) in names.into_iter().zip([self.requests, self.tokens]) {
            let Some(left) = left else { continue };
            let [limit, remaining, reset_name] = names;
            out.push((limit.clone(), left.limit.into()));
            out.push((remaining.clone(), left.remaining.into()));
            if let Ok(v) = http::HeaderValue::from_str(&reset(left.reset)) {
                out.push((reset_name.clone(), v));
            }
        }
        out
    }
}

/// OpenAI's rate-limit header names: limit, remaining and reset, of requests and of
/// tokens.
static REQUESTS: [HeaderName; 3] = [
    HeaderName::from_static("x-ratelimit-limit-requests"),
    HeaderName::from_static("x-ratelimit-remaining-requests"),
    HeaderName::from_static("x-ratelimit-reset-requests"),
];
static TOKENS: [HeaderName; 3] = [
    HeaderName::from_static("x-ratelimit-limit-tokens"),
    HeaderName::from_static("x-ratelimit-remaining-tokens"),
    HeaderName::from_static("x-ratelimit-reset-tokens"),
];

/// Anthropic's: limit, remaining and reset, of requests and of tokens.
static ANTHROPIC_REQUESTS: [HeaderName; 3] = [
    HeaderName::from_static("anthropic-ratelimit-requests-limit"),
    HeaderName::from_static("anthropic-ratelimit-requests-remaining"),
    HeaderName::from_static("anthropic-ratelimit-requests-reset"),
];
static ANTHROPIC_TOKENS: [HeaderName; 3] = [
    HeaderName::from_static("anthropic-ratelimit-tokens-limit"),
    HeaderName::from_static("anthropic-ratelimit-tokens-remaining"),
    HeaderName::from_static("anthropic-ratelimit-tokens-reset"),
];

/// A duration as Go prints one, as OpenAI's reset headers are: `"17ms"`, `"1.5s"`,
/// `"6m0s"`.
fn go_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let (minutes, rest_ms) = (ms / 60_000, ms % 60_000);
    let seconds = format!("{}.{:03}", rest_ms / 1000, rest_ms % 1000);
    let seconds = seconds.trim_end_matches('0').trim_end_matches('.');
    match minutes {
        0 => format!("{seconds}s"),
        m => format!("{m}m{seconds}s"),
    }
}

/// A tenant's request and token buckets (none where it has no such limit).
type Buckets = (Option<Bucket>, Option<Bucket>);

/// A request's charge to its tenant's token bucket: the estimate taken at admission,
/// settled against what the engine reports.
#[derive(Debug, Clone)]
pub struct Charge {
    pub limiter: Arc<Limiter>,
    pub tenant: Arc<str>,
    pub estimate: u64,
}

impl Charge {
    /// The engine reported `actual` tokens (prompt and output): the bucket gets back
    /// what was over-charged, or pays what was under-charged.
    pub fn settle(&self, actual: u64) {
        let delta = self.estimate as f64 - actual as f64;
        let mut all = self.limiter.buckets.lock();
        if let Some((_, Some(tokens))) = all.get_mut(&self.tenant) {
            tokens.level += delta;
        }
    }
}

/// A request's charge while it has no answer: given back in full if it ends so (the
/// request refused after admission, or its client gone while it waited); `None` once
/// it is answered.
#[derive(Debug)]
pub struct Refund(pub Option<Charge>);

impl Drop for Refund {
    fn drop(&mut self) {
        if let Some(charge) = self.0.take() {
            charge.settle(0);
        }
    }
}

/// The tenants' buckets, kept across reloads.
#[derive(Debug, Default)]
pub struct Limiter {
    buckets: Mutex<HashMap<Arc<str>, Buckets>>,
}

/// Most tenants with buckets (the oldest are dropped past it: they refill anyway).
const MAX_TENANTS: usize = 10_000;

impl Limiter {
    /// Charges one request of `tokens` to its tenant's buckets if neither is below
    /// zero, and says what is left (nothing for a tenant without limits); else which
    /// limit, how long until it would pass, and what is left (nothing charged).
    pub fn charge(
        &self,
        who: &Identity,
        tokens: u64,
        now: Instant,
    ) -> Result<Option<Standing>, Refusal> {
        let (rpm, tpm) = (who.config.requests_per_minute, who.config.tokens_per_minute);
        if rpm.is_none() && tpm.is_none() {
            return Ok(None);
        }
        let mut all = self.buckets.lock();
        if all.len() >= MAX_TENANTS && !all.contains_key(&who.tenant) {
            all.clear();
        }
        let (r, t) = all.entry(who.tenant.clone()).or_default();
        let check = |bucket: &mut Option<Bucket>, per_minute: Option<u64>, limit| {
            let Some(per_minute) = per_minute else {
                *bucket = None;
                return Ok(());
            };
            let b = bucket.get_or_insert_with(|| Bucket::full(per_minute, now));
            b.refill(per_minute, now);
            match b.wait(per_minute) {
                Some(wait) => Err((limit, wait)),
                None if b.level < 1.0 && limit == Limit::Requests => {
                    let missing = 1.0 - b.level;
                    Err((
                        limit,
                        Duration::from_secs_f64(missing * 60.0 / per_minute as f64),
                    ))
                }
                None => Ok(()),
            }
        };
        // Both refilled (the standing tells both), the first refusal told.
        let passes = [check(r, rpm, Limit::Requests), check(t, tpm, Limit::Tokens)];
        let refused = passes.into_iter().find_map(Result::err);
        if refused.is_none() {
            if let Some(b) = r.as_mut() {
                b.level -= 1.0;
            }
            if let Some(b) = t.as_mut() {
                b.level -= tokens as f64;
            }
        }
        let standing = Standing {
            requests: r.as_ref().zip(rpm).map(|(b, per)| b.left(per)),
            tokens: t.as_ref().zip(tpm).map(|(b, per)| b.left(per)),
        };
        match refused {
            None => Ok(Some(standing)),
            Some((limit, wait)) => Err(Refusal {
                limit,
                wait,
                standing,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tenancy(extra: &str) -> Tenancy {
        let text = format!(
            "[routing]\ntenant_header = \"x-tenant\"\npriority_header = \"x-priority\"\n\
             [[priorities]]\nname = \"interactive\"\n[[priorities]]\nname = \"batch\"\nmax_queue = 7\n\
             [[tenants]]\nname = \"etl\"\npriority = \"batch\"\nrequests_per_minute = 2\ntokens_per_minute = 600\n{extra}\
             [[pools]]\nname = \"p\"\nnodes = [{{ id = \"a\", url = \"http://h:1\" }}]\n"
        );
        crate::config::Config::parse(&text, "t").unwrap().tenancy
    }

    fn key(name: &str) -> Caller<'_> {
        Caller {
            key_name: Some(name),
            certified: None,
        }
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    #[test]
    fn the_key_names_the_tenant_else_the_header_and_a_class_can_only_be_lowered() {
        let t = tenancy("");
        assert_eq!(t.classes[1].max_queue, 7);
        let who = identify(&t, key("etl"), &headers(&[("x-tenant", "someone")]));
        assert_eq!((&*who.tenant, who.class, who.label()), ("etl", 1, "etl"));
        let who = identify(&t, Caller::default(), &headers(&[("x-tenant", "team-a")]));
        assert_eq!(
            (&*who.tenant, who.class, who.label()),
            ("team-a", 0, "other")
        );
        let who = identify(&t, Caller::default(), &headers(&[]));
        assert_eq!((&*who.tenant, who.class), ("default", 0));
        // Asking for batch lowers; etl asking for interactive stays batch.
        let who = identify(&t, Caller::default(), &headers(&[("x-priority", "batch")]));
        assert_eq!(who.class, 1);
        let who = identify(&t, key("etl"), &headers(&[("x-priority", "interactive")]));
        assert_eq!(who.class, 1);
        // A header that is no tenant name is ignored.
        let who = identify(
            &t,
            Caller::default(),
            &headers(&[("x-tenant", &"x".repeat(65))]),
        );
        assert_eq!(&*who.tenant, "default");
    }

    #[test]
    fn a_client_certificate_names_the_tenant_after_the_key_before_the_header() {
        let certified = CertifiedName("etl".into());
        let shown = |key_name| Caller {
            key_name,
            certified: Some(&certified),
        };
        let team = headers(&[("x-tenant", "team-a")]);
        // Off (the default): the certificate says nothing.
        let t = tenancy("");
        assert_eq!(&*identify(&t, shown(None), &team).tenant, "team-a");
        let mut t = tenancy("");
        t.tenant_from_certificate = true;
        let who = identify(&t, shown(None), &team);
        assert_eq!((&*who.tenant, who.class, who.label()), ("etl", 1, "etl"));
        let other = CertifiedName("svc-x".into());
        let who = identify(
            &t,
            Caller {
                key_name: None,
                certified: Some(&other),
            },
            &team,
        );
        assert_eq!((&*who.tenant, who.label()), ("svc-x", "other"));
        assert_eq!(&*identify(&t, shown(Some("ops")), &team).tenant, "ops");
    }

    #[test]
    fn a_deadline_from_the_client_only_shortens_the_wait() {
        let q = Duration::from_secs(30);
        assert_eq!(
            queue_deadline(&headers(&[("x-request-timeout", "2.5")]), q),
            Duration::from_millis(2500)
        );
        assert_eq!(
            queue_deadline(&headers(&[("x-request-timeout", "250ms")]), q),
            Duration::from_millis(250)
        );
        assert_eq!(
            queue_deadline(&headers(&[("x-request-timeout", "600")]), q),
            q
        );
        assert_eq!(
            queue_deadline(&headers(&[("x-request-timeout", "soon")]), q),
            q
        );
        assert_eq!(queue_deadline(&headers(&[]), q), q);
    }

    #[test]
    fn buckets_refuse_past_the_rate_say_when_and_refill() {
        let t = tenancy("");
        let etl = identify(&t, key("etl"), &HeaderMap::new());
        let free = identify(&t, Caller::default(), &HeaderMap::new());
        let l = Limiter::default();
        let t0 = Instant::now();
        // Each charge says what is left: etl has 2 requests and 600 tokens a minute.
        let first = l.charge(&etl, 100, t0).unwrap().unwrap();
        let secs = Duration::from_secs;
        let requests = first.requests.unwrap();
        assert_eq!(
            (requests.limit, requests.remaining, requests.reset),
            (2, 1, secs(30))
        );
        let tokens = first.tokens.unwrap();
        assert_eq!(
            (tokens.limit, tokens.remaining, tokens.reset),
            (600, 500, secs(10))
        );
        let second = l.charge(&etl, 100, t0).unwrap().unwrap();
        assert_eq!(second.requests.unwrap().remaining, 0);
        assert_eq!(second.tokens.unwrap().remaining, 400);
        // Two requests a minute: the third waits 30 s for its request.
        let Refusal {
            limit,
            wait,
            standing,
        } = l.charge(&etl, 100, t0).unwrap_err();
        let requests = standing.requests.unwrap();
        assert_eq!(
            (requests.limit, requests.remaining),
            (2, 0),
            "told, not charged"
        );
        assert_eq!(limit, Limit::Requests);
        assert!((29..=30).contains(&wait.as_secs()), "{wait:?}");
        // A minute on both refilled; a request bigger than what is left passes once,
        // then the debt is paid first.
        let t1 = t0 + Duration::from_secs(60);
        assert!(l.charge(&etl, 1000, t1).is_ok());
        let Refusal { limit, wait, .. } = l.charge(&etl, 1, t1).unwrap_err();
        assert_eq!(limit, Limit::Tokens);
        assert_eq!(wait.as_secs(), 40, "400 tokens of debt at 10 a second");
        // A tenant without limits is never refused, and has nothing to be told.
        for _ in 0..100 {
            assert_eq!(l.charge(&free, 1_000_000, t0), Ok(None));
        }
    }

    fn texts(headers: Vec<(HeaderName, http::HeaderValue)>) -> Vec<(String, String)> {
        headers
            .into_iter()
            .map(|(n, v)| (n.to_string(), v.to_str().unwrap().to_string()))
            .collect()
    }

    /// A tenant of 60 requests and 150,000 tokens a minute, after one request.
    fn sixty_a_minute() -> Standing {
        Standing {
            requests: Some(Left {
                limit: 60,
                remaining: 59,
                reset: Duration::from_secs(1),
            }),
            tokens: Some(Left {
                limit: 150_000,
                remaining: 149_984,
                reset: Duration::from_millis(6),
            }),
        }
    }

    #[test]
    fn what_is_left_is_told_in_anthropics_headers_on_its_api() {
        let standing = sixty_a_minute();
        // 2026-12-05T06:35:54Z; a reset part of a second away is the next second.
        let got = texts(standing.anthropic_headers(1_796_452_554));
        let want = [
            ("anthropic-ratelimit-requests-limit", "60"),
            ("anthropic-ratelimit-requests-remaining", "59"),
            ("anthropic-ratelimit-requests-reset", "2026-12-05T06:35:55Z"),
            ("anthropic-ratelimit-tokens-limit", "150000"),
            ("anthropic-ratelimit-tokens-remaining", "149984"),
            ("anthropic-ratelimit-tokens-reset", "2026-12-05T06:35:55Z"),
        ];
        let want: Vec<(String, String)> = want
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect();
        assert_eq!(got, want);
        let whole = Standing {
            requests: Some(Left {
                reset: Duration::ZERO,
                ..standing.requests.unwrap()
            }),
            tokens: None,
        };
        assert_eq!(
            texts(whole.anthropic_headers(1_796_452_554))[2].1,
            "2026-12-05T06:35:54Z"
        );
        // The API chooses the vocabulary.
        let names = |api| -> Vec<String> {
            let h = standing.headers_for(api);
            h.iter().map(|(n, _)| n.to_string()).collect()
        };
        assert!(names(Api::Messages)
            .iter()
            .all(|n| n.starts_with("anthropic-ratelimit-")));
        assert!(names(Api::Chat)
            .iter()
            .all(|n| n.starts_with("x-ratelimit-")));
    }

    #[test]
    fn what_is_left_is_told_in_openais_headers() {
        let standing = sixty_a_minute();
        let got = texts(standing.openai_headers());
        let want = [
            ("x-ratelimit-limit-requests", "60"),
            ("x-ratelimit-remaining-requests", "59"),
            ("x-ratelimit-reset-requests", "1s"),
            ("x-ratelimit-limit-tokens", "150000"),
            ("x-ratelimit-remaining-tokens", "149984"),
            ("x-ratelimit-reset-tokens", "6ms"),
        ];
        let want: Vec<(String, String)> = want
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect();
        assert_eq!(got, want);
        let only_tokens = Standing {
            requests: None,
            ..standing
        };
        assert_eq!(only_tokens.openai_headers().len(), 3);
        for (ms, text) in [
            (0, "0ms"),
            (999, "999ms"),
            (1500, "1.5s"),
            (60_000, "1m0s"),
            (361_250, "6m1.25s"),
        ] {
            assert_eq!(go_duration(Duration::from_millis(ms)), text);
        }
    }
}
