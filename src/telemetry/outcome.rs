//! The vocabulary for what happened to a request: why an attempt was
//! abandoned, and how the request ended (where it was routed is
//! [`Route`](crate::routing::route::Route)). Each has one spelling (`as_str`), used by
//! the logs and the metric labels; the metrics' label lists are these enums' `ALL`.

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
        assert_eq!(RequestOutcome::of_status(404).as_str(), "client_error");
        assert_eq!(RequestOutcome::of_status(503).as_str(), "rejected");
        assert_eq!(FailoverReason::Http5xx.as_str(), "http_5xx");
    }
}

/// How the engine holding a stored response was found
/// (`stored_response_requests_total{holder}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoredLookup {
    /// This balancer knew which engine holds it.
    Known,
    /// No table here knew it: engines were asked in turn and one held it.
    Found,
    /// Every engine asked answered that it does not hold it (the client reads a 404).
    Missing,
    /// Its engine takes no requests (the client reads a 503).
    Unavailable,
}

impl StoredLookup {
    pub const ALL: [StoredLookup; 4] = [
        StoredLookup::Known,
        StoredLookup::Found,
        StoredLookup::Missing,
        StoredLookup::Unavailable,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            StoredLookup::Known => "known",
            StoredLookup::Found => "found",
            StoredLookup::Missing => "missing",
            StoredLookup::Unavailable => "unavailable",
        }
    }
}
