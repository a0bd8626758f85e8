//! The admin listener (default `127.0.0.1:9091`, optional bearer token): liveness and
//! readiness (open without the token, for orchestrator probes), the status page at `/`
//! (open too: it holds no data), metrics, node state, the fleet summary, routing
//! explanations, drain/undrain and reload.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use crate::proxy::request_body::RequestBody;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use serde_json::{json, Value};

use super::control::Control;
use crate::proxy::body::{full, BoxBody};
use crate::routing::explain::explain;
use crate::routing::table::Table;

/// Handles one admin request.
pub async fn handle(
    control: Arc<Control>,
    req: Request<RequestBody>,
    _peer: SocketAddr,
) -> Response<BoxBody> {
    let table = control.table();
    let path = req.uri().path().to_string();
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    match (req.method(), segments.as_slice()) {
        (&Method::GET, ["healthz"]) => return json_ok(json!({"status": "ok"})),
        // The page holds no data: it asks for the token and sends it on every call.
        (&Method::GET, [""]) => return page(),
        (&Method::GET, ["readyz"]) => return readyz(&control),
        _ => {}
    }
    if let Some(token) = &table.config.server.admin_token {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "));
        if !given.is_some_and(|g| token.matches(g)) {
            return error(
                StatusCode::UNAUTHORIZED,
                "missing or wrong admin token (Authorization: Bearer …)",
            );
        }
    }
    match (req.method(), segments.as_slice()) {
        (&Method::GET, ["metrics"]) => {
            let mut resp = Response::new(full(control.metrics().render(&table)));
            resp.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            resp
        }
        (&Method::POST, ["admin", "reload"]) => match control.reload() {
            Ok(()) => json_ok(json!({"result": "ok"})),
            Err(e) => error(StatusCode::BAD_REQUEST, &e.to_string()),
        },
        (&Method::GET, ["admin", "nodes"]) => json_ok(nodes(&table)),
        (&Method::GET, ["admin", "summary"]) => json_ok(super::status::summary(&control)),
        (&Method::POST, ["admin", "explain"]) => explain_request(&table, req).await,
        (&Method::POST, ["admin", "nodes", id, action @ ("drain" | "undrain")]) => {
            drain(&table, id, *action == "drain")
        }
        _ => error(
            StatusCode::NOT_FOUND,
            &format!("no admin route {} {path}", req.method()),
        ),
    }
}

fn page() -> Response<BoxBody> {
    let mut resp = Response::new(full(super::status::PAGE));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    // Nothing from elsewhere: the page is whole as served.
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static("default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src 'self' data:"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

fn readyz(control: &Control) -> Response<BoxBody> {
    let table = control.table();
    let open = table
        .pools
        .iter()
        .flat_map(|p| p.balancer.nodes())
        .filter(|n| n.state().accepts_new())
        .count();
    if control.proxy().is_stopping() {
        error(StatusCode::SERVICE_UNAVAILABLE, "shutting down")
    } else if open == 0 {
        error(StatusCode::SERVICE_UNAVAILABLE, "no node accepts requests")
    } else {
        json_ok(json!({"status": "ready", "nodes_accepting": open}))
    }
}

fn nodes(table: &Table) -> Value {
    let now = Instant::now();
    let list: Vec<Value> = table
        .pools
        .iter()
        .flat_map(|pool| {
            let b = &pool.balancer;
            b.nodes().iter().map(move |n| {
                let state = n.state();
                let ttft = state.breaker.ttft_quantiles(b.settings(), now);
                let norm = state.breaker.summary(1);
                let ms = |d: std::time::Duration| d.as_secs_f64() * 1000.0;
                json!({
                    "id": n.id(),
                    "pool": pool.config.name,
                    "url": n.url().to_string(),
                    "weight": n.weight(),
                    "state": state.breaker.state().as_str(),
                    "in_flight": state.in_flight(),
                    "cap": b.cap_of(n),
                    "healthy": state.is_healthy(),
                    "check_error": state.check_error(),
                    "draining": state.is_draining(),
                    "ttft_p50_ms": ttft.map(|t| ms(t.0)),
                    "ttft_p90_ms": ttft.map(|t| ms(t.1)),
                    "normalized_ttft_p50": norm.map(|n| n.0.as_f64()),
                    "normalized_ttft_p90": norm.map(|n| n.1.as_f64()),
                    "shunt_ratio": state.breaker.shunt_ratio(),
                    "degraded": state.breaker.is_degraded(),
                    "prefill_backlog_tokens": state.prefill_backlog(),
                    "engine_load": state.engine_load(),
                    // Set when its engine's metrics name another number of
                    // data-parallel ranks than its server has here.
                    "engine_advice": state.engine_advice(),
                    "source": n.source().as_str(),
                    // The ids its engine's `/v1/models` last listed; null until read.
                    "models": state.served().map(|s| {
                        s.models.iter().map(|(id, _)| id.clone()).collect::<Vec<_>>()
                    }),
                })
            })
        })
        .collect();
    json!({ "nodes": list })
}

async fn explain_request(table: &Table, req: Request<RequestBody>) -> Response<BoxBody> {
    let path = req
        .uri()
        .query()
        .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("path=")))
        .unwrap_or("/v1/chat/completions")
        .to_string();
    let header_key = req
        .headers()
        .get(&table.config.routing.key_header)
        .map(|v| v.as_bytes().to_vec());
    let (parts, body) = req.into_parts();
    let headers = parts.headers;
    let body = match Limited::new(body, table.config.server.max_body_bytes)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                &format!("could not read body: {e}"),
            )
        }
    };
    match explain(table, &path, header_key.as_deref(), &body, Instant::now()) {
        Ok(x) => json_ok(explanation_json(table, x, &headers)),
        Err(e) => error(StatusCode::BAD_REQUEST, &e.to_string()),
    }
}

/// An explanation as `route` prints it and `/admin/explain` answers it: the routing
/// decision, with who the request would be and where it would wait (by its headers:
/// an explanation carries no API key).
pub fn explanation_json(
    table: &Table,
    x: crate::routing::explain::Explanation,
    headers: &http::HeaderMap,
) -> Value {
    let pool = x.pool.clone();
    let mut v = serde_json::to_value(x).unwrap_or(Value::Null);
    let tenancy = &table.config.tenancy;
    let who = crate::proxy::tenant::identify(tenancy, Default::default(), headers);
    let waiting = crate::routing::fair::Waiting {
        weight: who.config.weight,
        class: who.class,
        cost: 0.0,
        tenant: who.tenant.clone(),
    };
    let ahead = table
        .pools
        .iter()
        .find(|p| p.config.name == pool)
        .map(|p| p.balancer.load().queue_ahead(&waiting));
    v["tenant"] = json!(&*who.tenant);
    v["priority"] = json!(&*tenancy.classes[who.class].name);
    v["queue_ahead"] = json!(ahead);
    v
}

fn drain(table: &Table, id: &str, draining: bool) -> Response<BoxBody> {
    let Some((_, node)) = table.find_node(id) else {
        return error(StatusCode::NOT_FOUND, &format!("no node {id:?}"));
    };
    let state = node.state();
    if state.set_draining(draining) {
        tracing::info!(node = id, draining, "drain state changed");
    }
    json_ok(json!({"node": id, "draining": draining, "in_flight": state.in_flight()}))
}

fn json_ok(v: Value) -> Response<BoxBody> {
    json_response(StatusCode::OK, &v)
}

fn error(status: StatusCode, msg: &str) -> Response<BoxBody> {
    json_response(
        status,
        &json!({"error": {"message": msg, "type": "admin_error", "code": status.as_u16()}}),
    )
}

fn json_response(status: StatusCode, v: &Value) -> Response<BoxBody> {
    let mut resp = Response::new(full(v.to_string()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}
