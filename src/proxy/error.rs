//! The proxy's one error type and its mapping to an OpenAI-style JSON response
//! (`{"error": {"message", "type", "code"}}`) with the right status. Text that came
//! from a client or an engine is [`clip`]ped before it is echoed or logged.

use http::{header, HeaderValue, Response, StatusCode};
use serde_json::json;

use super::body::{full, BoxBody};
use crate::routing::facts::{Api, KeyError};
use crate::routing::table::{PlaceError, PoolError};

/// Everything that can end a request before an engine's response reaches the client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProxyError {
    #[error("{0}")]
    Place(#[from] PlaceError),
    #[error("could not read the request body: {0}")]
    BodyRead(String),
    #[error("request body exceeds the limit of {limit} bytes (server.max_body_bytes)")]
    BodyTooLarge { limit: usize },
    #[error("content-type `{got}` is not supported; send the body as {want}")]
    UnsupportedMediaType { got: String, want: &'static str },
    #[error("content-encoding `{0}` is not supported; send the body uncompressed (engines read plain JSON)")]
    UnsupportedEncoding(String),
    #[error("method {method} is not allowed on {path}; use POST")]
    MethodNotAllowed { method: String, path: String },
    #[error("invalid URL ({method} {path}): this balancer serves /v1/chat/completions, /v1/completions, /v1/responses (and /v1/responses/{{id}}), /v1/embeddings, /v1/audio/transcriptions, /v1/audio/translations, /v1/messages, /v1/messages/count_tokens, /generate, vLLM's /v1/rerank, /score, /pooling, /classify, /tokenize, /detokenize, and /v1/models")]
    UnknownPath { method: String, path: String },
    #[error("tenant `{tenant}` is over its {limit} limit; retry in {retry_after_secs} s")]
    RateLimited {
        tenant: String,
        limit: &'static str,
        retry_after_secs: u32,
        /// The same, to the millisecond: `retry-after-ms`, which the OpenAI and
        /// Anthropic SDKs read before `Retry-After`.
        retry_after_ms: u32,
        /// What is left, for the rate-limit headers (boxed: the error stays small).
        standing: Box<super::tenant::Standing>,
    },
    #[error("missing or invalid API key (send Authorization: Bearer <key>, or x-api-key: <key> to /v1/messages)")]
    Unauthorized,
    #[error("the request body did not arrive within {after_ms} ms (server.body_read_timeout)")]
    BodyTimeout { after_ms: u128 },
    #[error("the balancer is holding its limit of request bytes (server.max_buffered_bytes); retry shortly")]
    BufferFull,
    #[error("all nodes of pool `{pool}` are at their in-flight cap")]
    Saturated { pool: String },
    #[error("the queue of pool `{pool}` is full ({max} requests waiting)")]
    QueueFull { pool: String, max: usize },
    #[error("no node of pool `{pool}` freed a slot within {waited_ms} ms")]
    QueueTimeout { pool: String, waited_ms: u128 },
    #[error("no node of pool `{pool}` is accepting requests (all down or draining)")]
    NoNode { pool: String },
    /// The stored response a request names is on one engine only, and that engine
    /// takes no requests now.
    #[error("response `{id}` is stored on node `{node}` alone, which is not accepting requests (down, draining or its breaker open); no other engine holds it")]
    HolderUnavailable { id: String, node: String },
    #[error("every engine tried is busy (429): {attempts}")]
    Busy { attempts: String },
    #[error("all {count} attempts failed: {attempts}")]
    Upstream { count: u32, attempts: String },
    #[error("no engine answered in time: {attempts}")]
    UpstreamTimeout { attempts: String },
    /// A disaggregated request's prefill engine answered without the params a decode
    /// engine needs to pull its KV cache.
    #[error("prefill node `{node}` answered without kv_transfer_params: is its engine started with a KV connector (vLLM --kv-transfer-config)?")]
    NoKvTransfer { node: String },
}

impl ProxyError {
    pub fn status(&self) -> StatusCode {
        match self {
            ProxyError::Place(PlaceError::Pool(PoolError::UnknownModel { .. })) => {
                StatusCode::NOT_FOUND
            }
            ProxyError::Place(PlaceError::Pool(PoolError::NoThinking { .. })) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ProxyError::Place(_) | ProxyError::BodyRead(_) => StatusCode::BAD_REQUEST,
            ProxyError::UnknownPath { .. } => StatusCode::NOT_FOUND,
            ProxyError::Unauthorized => StatusCode::UNAUTHORIZED,
            ProxyError::RateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
            ProxyError::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            ProxyError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::UnsupportedMediaType { .. } | ProxyError::UnsupportedEncoding(_) => {
                StatusCode::UNSUPPORTED_MEDIA_TYPE
            }
            ProxyError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ProxyError::Saturated { .. }
            | ProxyError::QueueFull { .. }
            | ProxyError::QueueTimeout { .. }
            | ProxyError::NoNode { .. }
            | ProxyError::HolderUnavailable { .. }
            | ProxyError::BufferFull
            | ProxyError::Busy { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ProxyError::Upstream { .. } | ProxyError::NoKvTransfer { .. } => {
                StatusCode::BAD_GATEWAY
            }
            ProxyError::UpstreamTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
        }
    }

    /// The OpenAI error `type`.
    pub fn kind(&self) -> &'static str {
        match self.status() {
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            s if s.is_client_error() => "invalid_request_error",
            StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
            _ => "upstream_error",
        }
    }

    /// A stable machine-readable `code`.
    pub fn code(&self) -> &'static str {
        match self {
            ProxyError::Place(PlaceError::Pool(PoolError::UnknownModel { .. })) => {
                "model_not_found"
            }
            ProxyError::Place(PlaceError::Pool(PoolError::ModelRequired { .. })) => {
                "model_required"
            }
            ProxyError::Place(PlaceError::Pool(PoolError::NoThinking { .. })) => {
                "no_available_node"
            }
            ProxyError::Place(PlaceError::Key(KeyError::Empty)) => "empty_body",
            ProxyError::Place(PlaceError::Key(KeyError::Json(_))) => "invalid_json",
            ProxyError::Place(PlaceError::Key(KeyError::Form(_))) => "invalid_form",
            ProxyError::Place(PlaceError::Key(KeyError::NotText(_) | KeyError::Invalid(_))) => {
                "invalid_parameter"
            }
            ProxyError::Place(PlaceError::Key(KeyError::Missing(_))) => {
                "missing_required_parameter"
            }
            ProxyError::BodyRead(_) => "body_read_error",
            ProxyError::BodyTooLarge { .. } => "request_too_large",
            ProxyError::UnsupportedMediaType { .. } => "unsupported_media_type",
            ProxyError::UnsupportedEncoding(_) => "unsupported_content_encoding",
            ProxyError::MethodNotAllowed { .. } => "method_not_allowed",
            ProxyError::UnknownPath { .. } => "unknown_url",
            ProxyError::Unauthorized => "invalid_api_key",
            ProxyError::RateLimited { .. } => "rate_limit_exceeded",
            ProxyError::BodyTimeout { .. } => "body_read_timeout",
            ProxyError::BufferFull => "buffer_full",
            ProxyError::Saturated { .. } => "saturated",
            ProxyError::QueueFull { .. } => "queue_full",
            ProxyError::QueueTimeout { .. } => "queue_timeout",
            ProxyError::NoNode { .. } => "no_available_node",
            ProxyError::HolderUnavailable { .. } => "stored_response_unavailable",
            ProxyError::Busy { .. } => "engines_busy",
            ProxyError::Upstream { .. } => "upstream_failed",
            ProxyError::UpstreamTimeout { .. } => "upstream_timeout",
            ProxyError::NoKvTransfer { .. } => "no_kv_transfer_params",
        }
    }

    /// Seconds a client should wait before retrying, for "try again later" errors.
    pub fn retry_after(&self) -> Option<u32> {
        if let ProxyError::RateLimited {
            retry_after_secs, ..
        } = self
        {
            return Some(*retry_after_secs);
        }
        (self.status() == StatusCode::SERVICE_UNAVAILABLE).then_some(1)
    }
}

impl ProxyError {
    /// Anthropic's error `type` for this error's status.
    pub fn anthropic_kind(&self) -> &'static str {
        anthropic_kind(self.status())
    }

    /// The error as a response in the API's own shape: Anthropic's
    /// `{"type": "error", "error": {"type", "message"}}` on its paths, OpenAI's
    /// `{"error": {"message", "type", "code"}}` everywhere else.
    ///
    /// A 429 for a rate limit tells what is left in the API's rate-limit headers, as
    /// OpenAI's and Anthropic's own 429s do.
    pub fn into_response(self, api: Api) -> Response<BoxBody> {
        let limits = match &self {
            ProxyError::RateLimited { standing, .. } => standing.headers_for(api),
            _ => Vec::new(),
        };
        let mut resp = match api.is_anthropic() {
            false => self.into(),
            true => {
                let body = json!({"type": "error", "error": {"type": self.anthropic_kind(), "message": self.to_string()}});
                respond(&self, body)
            }
        };
        resp.headers_mut().extend(limits);
        resp
    }
}

/// Anthropic's error `type` for a status (its SDKs map the status, its clients read
/// the type).
pub fn anthropic_kind(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        504 => "timeout_error",
        s if (400..500).contains(&s) => "invalid_request_error",
        _ => "api_error",
    }
}

/// The wait before a retry in milliseconds (the SDKs' own header, beside the
/// standard `Retry-After` in whole seconds).
static RETRY_AFTER_MS: http::HeaderName = http::HeaderName::from_static("retry-after-ms");

fn respond(e: &ProxyError, body: serde_json::Value) -> Response<BoxBody> {
    let mut resp = Response::new(full(body.to_string()));
    *resp.status_mut() = e.status();
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Some(secs) = e.retry_after() {
        h.insert(header::RETRY_AFTER, HeaderValue::from(secs));
    }
    if let ProxyError::RateLimited { retry_after_ms, .. } = e {
        h.insert(RETRY_AFTER_MS.clone(), HeaderValue::from(*retry_after_ms));
    }
    resp
}

impl From<ProxyError> for Response<BoxBody> {
    fn from(e: ProxyError) -> Self {
        let body = json!({"error": {"message": e.to_string(), "type": e.kind(), "code": e.code()}});
        respond(&e, body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    async fn render(e: ProxyError) -> (StatusCode, Option<String>, serde_json::Value) {
        let resp: Response<BoxBody> = e.into();
        let status = resp.status();
        let retry = resp
            .headers()
            .get(header::RETRY_AFTER)
            .map(|v| v.to_str().unwrap().to_string());
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        (status, retry, serde_json::from_slice(&body).unwrap())
    }

    #[tokio::test]
    async fn errors_map_to_status_and_openai_json() {
        let cases = [
            (
                ProxyError::Place(PlaceError::Key(KeyError::Json("eof".into()))),
                400,
                "invalid_json",
                None,
            ),
            (
                ProxyError::Place(PlaceError::Pool(PoolError::UnknownModel {
                    model: "x".into(),
                    available: "a, b".into(),
                })),
                404,
                "model_not_found",
                None,
            ),
            (
                ProxyError::BodyTooLarge { limit: 10 },
                413,
                "request_too_large",
                None,
            ),
            (
                ProxyError::UnsupportedMediaType {
                    got: "text/plain".into(),
                    want: "application/json",
                },
                415,
                "unsupported_media_type",
                None,
            ),
            (
                ProxyError::UnsupportedEncoding("gzip".into()),
                415,
                "unsupported_content_encoding",
                None,
            ),
            (
                ProxyError::UnknownPath {
                    method: "POST".into(),
                    path: "/flush_cache".into(),
                },
                404,
                "unknown_url",
                None,
            ),
            (ProxyError::Unauthorized, 401, "invalid_api_key", None),
            (
                ProxyError::BodyTimeout { after_ms: 30_000 },
                408,
                "body_read_timeout",
                None,
            ),
            (ProxyError::BufferFull, 503, "buffer_full", Some("1")),
            (
                ProxyError::Saturated { pool: "p".into() },
                503,
                "saturated",
                Some("1"),
            ),
            (
                ProxyError::NoNode { pool: "p".into() },
                503,
                "no_available_node",
                Some("1"),
            ),
            (
                ProxyError::Upstream {
                    count: 2,
                    attempts: "a: refused".into(),
                },
                502,
                "upstream_failed",
                None,
            ),
        ];
        for (err, status, code, retry) in cases {
            let (s, r, body) = render(err).await;
            assert_eq!(s.as_u16(), status, "{body}");
            assert_eq!(body["error"]["code"], code);
            assert!(body["error"]["message"].as_str().unwrap().len() > 5);
            assert!(body["error"]["type"].is_string());
            assert_eq!(r.as_deref(), retry);
        }
    }
}
