//! Where a request was sent: the `x-prefixlb-route` header, the `route` label of
//! `routing_decisions_total` and the `route` of an explanation, in one vocabulary.

use std::borrow::Cow;

/// Where a request was sent (`x-prefixlb-route`, `routing_decisions_total{route}`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// The key's first node.
    Primary,
    /// The N-th node of the key's walk (the nodes before it were full or unwilling).
    Spill(usize),
    /// Diverted by latency shunting to the key's next node.
    Shunt,
    /// Waited in the pool's queue for a slot.
    Queued,
    /// Sent to this fallback pool.
    Fallback(String),
}

impl Route {
    /// The route of a node found at `distance` along the key's walk (`shunted`: an
    /// earlier node's shunting sent the key on).
    pub fn walked(distance: usize, shunted: bool) -> Route {
        match (shunted, distance) {
            (true, _) => Route::Shunt,
            (false, 0) => Route::Primary,
            (false, d) => Route::Spill(d),
        }
    }

    /// The metric label (bounded: no distance, no pool name).
    pub fn kind(&self) -> RouteKind {
        match self {
            Route::Primary => RouteKind::Primary,
            Route::Spill(_) => RouteKind::Spill,
            Route::Shunt => RouteKind::Shunt,
            Route::Queued => RouteKind::Queued,
            Route::Fallback(_) => RouteKind::Fallback,
        }
    }

    /// The header value: `primary`, `spill:N`, `shunt`, `queued`, `fallback:POOL`.
    pub fn label(&self) -> Cow<'static, str> {
        match self {
            Route::Spill(n) => Cow::Owned(format!("spill:{n}")),
            Route::Fallback(pool) => Cow::Owned(format!("fallback:{pool}")),
            other => Cow::Borrowed(other.kind().as_str()),
        }
    }
}

/// [`Route`] without its detail: the `route` label of `routing_decisions_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouteKind {
    Primary,
    Spill,
    Shunt,
    Queued,
    Fallback,
}

impl RouteKind {
    pub const ALL: [RouteKind; 5] = [
        RouteKind::Primary,
        RouteKind::Spill,
        RouteKind::Shunt,
        RouteKind::Queued,
        RouteKind::Fallback,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RouteKind::Primary => "primary",
            RouteKind::Spill => "spill",
            RouteKind::Shunt => "shunt",
            RouteKind::Queued => "queued",
            RouteKind::Fallback => "fallback",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels() {
        assert_eq!(Route::walked(2, false).label(), "spill:2");
        assert_eq!(Route::walked(0, false), Route::Primary);
        assert_eq!(Route::walked(3, true), Route::Shunt);
        assert_eq!(Route::Fallback("big".into()).label(), "fallback:big");
        assert_eq!(Route::Queued.label(), "queued");
        assert_eq!(Route::Spill(3).kind().as_str(), "spill");
    }
}
