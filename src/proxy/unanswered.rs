//! A request until the head of its answer (or its error) is ready. It records where
//! the request stands: its pool once placed, and the node of the attempt in progress.
//! The client may leave before then: a closed connection or an HTTP/2 reset drops the
//! request's future while it reads the body, waits in the queue, or waits for the
//! engine through a cold prefill. Such a request is then counted and logged as
//! `cancelled`, as one whose client leaves during the body is ([`super::relay`]).
//! Without this it would be in neither the metrics nor the log. (A shutdown whose
//! grace runs out drops the requests left the same way, after its own warning.)

use tokio::time::Instant;

use crate::telemetry::metrics::RequestMetrics;
use crate::telemetry::outcome::RequestOutcome;
use crate::telemetry::series::NodeSeries;
use crate::telemetry::traces;

/// Where a request stands before its answer.
pub struct Progress<'t> {
    /// Its id (`x-request-id`: [`super::request_id`]; none with `server.request_ids`
    /// off).
    pub id: Option<super::request_id::RequestId>,
    /// Its pool, once placed.
    pub pool: Option<&'t str>,
    /// The node asked now, by its metric series (none in the queue or between
    /// attempts).
    pub asking: Option<&'static NodeSeries>,
    /// Told once it is placed as a stream, when a keep-alive may commit it early
    /// (`server.sse_keepalive`).
    pub stream_seen: Option<std::sync::Arc<super::keepalive::StreamSeen>>,
}

/// A request not answered yet: counted and logged as `cancelled` if dropped so.
pub struct Unanswered<'t> {
    metrics: &'t RequestMetrics,
    started: Instant,
    /// The request's trace span.
    pub span: tracing::Span,
    pub at: Progress<'t>,
    answered: bool,
}

impl<'t> Unanswered<'t> {
    pub fn new(
        metrics: &'t RequestMetrics,
        started: Instant,
        span: tracing::Span,
        id: Option<super::request_id::RequestId>,
    ) -> Self {
        Unanswered {
            metrics,
            started,
            span,
            at: Progress {
                id,
                pool: None,
                asking: None,
                stream_seen: None,
            },
            answered: false,
        }
    }

    /// When it began.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// The answer (or the error) is ready: from here on it is the response's to count.
    pub fn answered(&mut self) {
        self.answered = true;
    }
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if self.answered {
            return;
        }
        let outcome = RequestOutcome::Cancelled;
        let duration = self.started.elapsed();
        let (pool, node) = match self.at.asking {
            Some(series) => {
                series.observe_request(outcome, duration);
                series.names()
            }
            None => {
                let pool = self.at.pool.unwrap_or("none");
                self.metrics.count_unanswered(pool, outcome);
                (pool, "none")
            }
        };
        traces::record_cancelled(&self.span);
        tracing::info!(
            pool,
            node,
            request_id = self
                .at
                .id
                .as_ref()
                .map(|id| super::request_id::text(&id.value)),
            outcome = outcome.as_str(),
            duration_ms = duration.as_millis() as u64,
            "request cancelled before its answer"
        );
    }
}
