//! The data plane's vocabulary for what happened to a request: where it was routed,
//! why an attempt was abandoned, and how the request ended. Each has one spelling
//! (`as_str`), used by the response headers, the logs and the metric labels; the
//! metrics' label lists are these enums' `ALL`.

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
    pub fn label(&self) -> String {
        match self {
            Route::Spill(n) => format!("spill:{n}"),
            Route::Fallback(pool) => format!("fallback:{pool}"),
            other => other.kind().as_str().to_string(),
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

/// Why an attempt was abandoned before commit (`failovers_total{reason}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailoverReason {
    /// Transport error, broken stream, SSE error event.
    Error,
    Http5xx,
    /// No response head, or no first token, in time.
    Timeout,
    /// The stream ended with no output and no `finish_reason`.
    NoContent,
    /// 429: the engine is busy (not a failure of the node).
    Busy,
}

impl FailoverReason {
    pub const ALL: [FailoverReason; 5] = [
        FailoverReason::Error,
        FailoverReason::Http5xx,
        FailoverReason::Timeout,
        FailoverReason::NoContent,
        FailoverReason::Busy,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FailoverReason::Error => "error",
            FailoverReason::Http5xx => "http_5xx",
            FailoverReason::Timeout => "timeout",
            FailoverReason::NoContent => "no_content",
            FailoverReason::Busy => "busy",
        }
    }
}

/// How a request ended (`requests_total{outcome}`, the log line's `outcome`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestOutcome {
    Success,
    /// A 4xx: the client's fault.
    ClientError,
    /// Every attempt failed.
    Error,
    /// Failed after commit (an error event or a cut body).
    Interrupted,
    /// 503: no capacity, queue full or timed out, no node.
    Rejected,
    /// The client left first.
    Cancelled,
}

impl RequestOutcome {
    pub const ALL: [RequestOutcome; 6] = [
        RequestOutcome::Success,
        RequestOutcome::ClientError,
        RequestOutcome::Error,
        RequestOutcome::Interrupted,
        RequestOutcome::Rejected,
        RequestOutcome::Cancelled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RequestOutcome::Success => "success",
            RequestOutcome::ClientError => "client_error",
            RequestOutcome::Error => "error",
            RequestOutcome::Interrupted => "interrupted",
            RequestOutcome::Rejected => "rejected",
            RequestOutcome::Cancelled => "cancelled",
        }
    }

    /// The outcome a response status stands for.
    pub fn of_status(status: u16) -> RequestOutcome {
        match status {
            503 => RequestOutcome::Rejected,
            400..=499 => RequestOutcome::ClientError,
            500.. => RequestOutcome::Error,
            _ => RequestOutcome::Success,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels() {
        assert_eq!(Route::Spill(2).label(), "spill:2");
        assert_eq!(Route::Fallback("big".into()).label(), "fallback:big");
        assert_eq!(Route::Queued.label(), "queued");
        assert_eq!(Route::Spill(3).kind().as_str(), "spill");
        assert_eq!(RequestOutcome::of_status(404).as_str(), "client_error");
    }
}
