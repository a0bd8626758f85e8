//! Who a request is and how it waits (`[[priorities]]`, `[[tenants]]`, and
//! `routing.tenant_header` / `priority_header`): the validated settings of the fair
//! admission queue and the per-tenant rate limits.

use std::collections::HashMap;

use serde::Deserialize;
use toml::Spanned;

use super::validate::Invalid;

/// `[[priorities]]`: a priority class, highest first.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrioritySection {
    pub name: Spanned<String>,
    /// Requests of this class waiting per pool before 503. Default `routing.max_queue`.
    pub max_queue: Option<Spanned<usize>>,
}

/// `[[tenants]]`: one tenant's class, share and limits.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantSection {
    pub name: Spanned<String>,
    /// Its priority class. Default `routing.default_priority`.
    pub priority: Option<Spanned<String>>,
    /// Its share of its class when the pool is saturated, against other tenants'
    /// weights. Default 1.
    pub weight: Option<Spanned<f64>>,
    /// Prompt plus completion tokens per minute (estimated at admission, corrected
    /// from the engine's usage). Default: no limit.
    pub tokens_per_minute: Option<Spanned<u64>>,
    /// Requests per minute. Default: no limit.
    pub requests_per_minute: Option<Spanned<u64>>,
}

/// A priority class.
#[derive(Debug, Clone, PartialEq)]
pub struct ClassConfig {
    pub name: std::sync::Arc<str>,
    pub max_queue: usize,
}

/// A configured tenant.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantConfig {
    /// Index into [`Tenancy::classes`].
    pub class: usize,
    pub weight: f64,
    pub tokens_per_minute: Option<u64>,
    pub requests_per_minute: Option<u64>,
}

/// How requests are told apart and ordered when a pool is saturated.
#[derive(Debug, Clone)]
pub struct Tenancy {
    /// Highest first; at least one (`default` when none is configured).
    pub classes: Vec<ClassConfig>,
    /// The class of a tenant that names none, and of unknown tenants.
    pub default_class: usize,
    pub tenants: HashMap<String, TenantConfig>,
    /// A header naming the tenant of a request whose API key has no name.
    pub tenant_header: Option<http::HeaderName>,
    /// The name in a client's certificate names its tenant (before the header).
    pub tenant_from_certificate: bool,
    /// A header by which a request may ask for a class at or below its tenant's.
    pub priority_header: Option<http::HeaderName>,
    /// The name every request without its own shares: `default`.
    pub default_tenant: std::sync::Arc<str>,
    /// Requests are told apart by tenant (`[[tenants]]`, `tenant_header`, client
    /// certificates or named API keys): their tokens are counted per tenant
    /// (`tenant_tokens_total`).
    pub counts_usage: bool,
}

impl Tenancy {
    /// The class index of `name`.
    pub fn class(&self, name: &str) -> Option<usize> {
        self.classes.iter().position(|c| &*c.name == name)
    }

    /// A tenant's settings (an unknown tenant: the default class, weight 1, no limits).
    pub fn tenant(&self, name: &str) -> TenantConfig {
        self.tenants.get(name).cloned().unwrap_or(TenantConfig {
            class: self.default_class,
            weight: 1.0,
            tokens_per_minute: None,
            requests_per_minute: None,
        })
    }
}

fn header(name: Option<String>, key: &str) -> Result<Option<http::HeaderName>, Invalid> {
    name.map(|n| {
        http::HeaderName::from_bytes(n.trim().to_ascii_lowercase().as_bytes())
            .map_err(|_| (None, format!("routing.{key} {n:?} is not a header name")))
    })
    .transpose()
}

/// Validates the sections; `max_queue` is `routing.max_queue`.
pub(super) fn validate(
    priorities: Vec<PrioritySection>,
    tenants: Vec<TenantSection>,
    default_priority: Option<Spanned<String>>,
    tenant_header: Option<String>,
    priority_header: Option<String>,
    max_queue: usize,
) -> Result<Tenancy, Invalid> {
    let mut classes = Vec::with_capacity(priorities.len().max(1));
    for p in &priorities {
        let name = p.name.get_ref().trim();
        if name.is_empty() || classes.iter().any(|c: &ClassConfig| &*c.name == name) {
            return Err((
                Some(p.name.span()),
                format!("priority {name:?} is empty or named twice"),
            ));
        }
        let bound = match &p.max_queue {
            Some(m) if *m.get_ref() == 0 || *m.get_ref() > 1 << 20 => {
                return Err((
                    Some(m.span()),
                    "max_queue is out of range 1..=1048576".into(),
                ))
            }
            Some(m) => *m.get_ref(),
            None => max_queue,
        };
        classes.push(ClassConfig {
            name: name.into(),
            max_queue: bound,
        });
    }
    if classes.is_empty() {
        classes.push(ClassConfig {
            name: "default".into(),
            max_queue,
        });
    }
    let class_of = |s: &Spanned<String>| {
        classes
            .iter()
            .position(|c| &*c.name == s.get_ref().trim())
            .ok_or_else(|| {
                let known: Vec<_> = classes.iter().map(|c| &*c.name).collect();
                (
                    Some(s.span()),
                    format!(
                        "priority {:?} is not one of [[priorities]] ({})",
                        s.get_ref(),
                        known.join(", ")
                    ),
                )
            })
    };
    let default_class = default_priority
        .as_ref()
        .map(class_of)
        .transpose()?
        .unwrap_or(0);
    let mut by_name = HashMap::new();
    for t in &tenants {
        let name = t.name.get_ref().trim().to_string();
        if name.is_empty() || by_name.contains_key(&name) {
            return Err((
                Some(t.name.span()),
                format!("tenant {name:?} is empty or named twice"),
            ));
        }
        let weight = match &t.weight {
            Some(w) if !(0.01..=1000.0).contains(w.get_ref()) => {
                return Err((Some(w.span()), "weight is out of range 0.01..=1000".into()))
            }
            Some(w) => *w.get_ref(),
            None => 1.0,
        };
        let positive = |v: &Option<Spanned<u64>>, key: &str| match v {
            Some(v) if *v.get_ref() == 0 => Err((
                Some(v.span()),
                format!("{key} must be at least 1 (leave it out for no limit)"),
            )),
            v => Ok(v.as_ref().map(|v| *v.get_ref())),
        };
        let config = TenantConfig {
            class: t
                .priority
                .as_ref()
                .map(class_of)
                .transpose()?
                .unwrap_or(default_class),
            weight,
            tokens_per_minute: positive(&t.tokens_per_minute, "tokens_per_minute")?,
            requests_per_minute: positive(&t.requests_per_minute, "requests_per_minute")?,
        };
        by_name.insert(name, config);
    }
    Ok(Tenancy {
        classes,
        default_class,
        tenants: by_name,
        tenant_header: header(tenant_header, "tenant_header")?,
        // Set once `[server]` is read (it takes client certificates).
        tenant_from_certificate: false,
        priority_header: header(priority_header, "priority_header")?,
        default_tenant: "default".into(),
        // Set once `[auth]` is read (its keys' names are tenants too).
        counts_usage: false,
    })
}
