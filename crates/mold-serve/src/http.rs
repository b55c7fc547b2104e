//! The HTTP side (axum): routes, the bearer token, body limits, errors as one line in
//! OpenAI's error shape, server-sent progress, and cancellation when a client goes away
//! (its handler or event stream is dropped, which sets the request's cancel flag).

use crate::api::{self, Refusal};
use crate::engine::{Engine, Event, Failure, Image};
use crate::metrics::Outcome;
use crate::options::ServeOptions;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use base64::Engine as _;
use mold_models::ModelSpec;
use serde_json::json;
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};

/// What every handler sees.
pub struct AppState {
    pub engine: Arc<Engine>,
    pub opts: ServeOptions,
    pub model: ModelSpec,
}

type App = State<Arc<AppState>>;

/// Sets a request's cancel flag when dropped, unless it finished.
struct CancelOnDrop {
    flag: Arc<AtomicBool>,
    armed: bool,
}

impl CancelOnDrop {
    fn new(flag: Arc<AtomicBool>) -> Self {
        CancelOnDrop { flag, armed: true }
    }
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            self.flag.store(true, Ordering::Relaxed);
        }
    }
}

fn error(status: StatusCode, kind: &str, message: &str) -> Response {
    let body = json!({"error": {"message": message, "type": kind, "code": status.as_u16()}});
    (status, axum::Json(body)).into_response()
}

fn refused(st: &AppState, r: Refusal) -> Response {
    st.engine.metrics.count(Outcome::Rejected, 1);
    let status = StatusCode::from_u16(r.status).unwrap_or(StatusCode::BAD_REQUEST);
    error(status, "invalid_request_error", &r.message)
}

/// The refusal of a request without the server's bearer token (none when it has none).
fn deny(st: &AppState, headers: &HeaderMap) -> Option<Response> {
    let want = st.opts.token.as_ref()?;
    let got = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    // Compared in constant time over the token's length.
    let ok = got.is_some_and(|g| {
        g.len() == want.len()
            && g.bytes()
                .zip(want.bytes())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    });
    if ok {
        return None;
    }
    st.engine.metrics.count(Outcome::Rejected, 1);
    Some(error(
        StatusCode::UNAUTHORIZED,
        "authentication_error",
        "authorization: missing or wrong bearer token; send `Authorization: Bearer <token>` with the token in the server's --token-file",
    ))
}

fn overloaded(capacity: usize) -> Response {
    error(
        StatusCode::TOO_MANY_REQUESTS,
        "rate_limit_error",
        &format!("queue full: {capacity} requests are waiting already; retry later"),
    )
}

fn failed(message: &str) -> Response {
    error(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
}

/// The routes, with the body limit.
pub fn router(state: Arc<AppState>) -> Router {
    let limit = state.opts.max_body_bytes;
    Router::new()
        .route("/health", get(health))
        .route("/status", get(status))
        .route("/metrics", get(metrics))
        .route("/v1/images/generations", post(images))
        .route("/v1/generate", post(generate))
        .route("/v1/generate/stream", post(generate_stream))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

async fn not_found() -> Response {
    error(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "no such route: POST /v1/images/generations, /v1/generate, /v1/generate/stream; GET /health, /status, /metrics",
    )
}

async fn health() -> Response {
    axum::Json(json!({"status": "ok"})).into_response()
}

async fn status(State(st): App, headers: HeaderMap) -> Response {
    if let Some(r) = deny(&st, &headers) {
        return r;
    }
    axum::Json(st.engine.status()).into_response()
}

async fn metrics(State(st): App, headers: HeaderMap) -> Response {
    if let Some(r) = deny(&st, &headers) {
        return r;
    }
    let text = st.engine.metrics.render(&st.engine.gauges());
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4"),
        )],
        text,
    )
        .into_response()
}

/// A body too large comes as a rejection of `Bytes`: one line, 413.
fn body_or_refusal(
    st: &AppState,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Result<Bytes, Box<Response>> {
    body.map_err(|e| {
        Box::new(refused(
            st,
            Refusal {
                status: e.status().as_u16(),
                message: format!(
                    "body: {}; this server takes at most {} bytes",
                    e.body_text().replace('\n', " "),
                    st.opts.max_body_bytes
                ),
            },
        ))
    })
}

/// Waits for the images of one admission, cancelling them if the client goes away.
async fn wait_all(
    rxs: Vec<oneshot::Receiver<Result<Image, Failure>>>,
    cancel: Arc<AtomicBool>,
) -> Result<Vec<Image>, Failure> {
    let guard = CancelOnDrop::new(cancel);
    let mut out = Vec::new();
    let mut first_err = None;
    for rx in rxs {
        match rx.await {
            Ok(Ok(img)) => out.push(img),
            Ok(Err(e)) => {
                first_err.get_or_insert(e);
            }
            Err(_) => {
                first_err.get_or_insert("the server stopped before the image was made".into());
            }
        }
    }
    guard.disarm();
    match first_err {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

async fn images(
    State(st): App,
    headers: HeaderMap,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Response {
    if let Some(r) = deny(&st, &headers) {
        return r;
    }
    let body = match body_or_refusal(&st, body) {
        Ok(b) => b,
        Err(r) => return *r,
    };
    let checked = api::parse::<api::ImagesRequest>(&body)
        .and_then(|r| api::check_images(&r, &st.opts, &st.model, st.engine.plan()));
    let checked = match checked {
        Ok(c) => c,
        Err(r) => return refused(&st, r),
    };
    let cancel = Arc::new(AtomicBool::new(false));
    let rxs = match st.engine.submit(checked.requests, cancel.clone(), None) {
        Ok(r) => r,
        Err(o) => return overloaded(o.capacity),
    };
    match wait_all(rxs, cancel).await {
        Ok(imgs) => {
            let created = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            let data: Vec<serde_json::Value> = imgs
                .iter()
                .map(|i| {
                    json!({
                        "b64_json": base64::engine::general_purpose::STANDARD.encode(&i.png),
                        "seed": i.seed,
                    })
                })
                .collect();
            axum::Json(json!({"created": created, "data": data})).into_response()
        }
        Err(e) => failed(&e),
    }
}

fn generate_checked(st: &AppState, body: &[u8]) -> Result<api::Checked, Refusal> {
    api::parse::<api::GenerateRequest>(body)
        .and_then(|r| api::check_generate(&r, &st.opts, &st.model, st.engine.plan()))
}

async fn generate(
    State(st): App,
    headers: HeaderMap,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Response {
    if let Some(r) = deny(&st, &headers) {
        return r;
    }
    let body = match body_or_refusal(&st, body) {
        Ok(b) => b,
        Err(r) => return *r,
    };
    let checked = match generate_checked(&st, &body) {
        Ok(c) => c,
        Err(r) => return refused(&st, r),
    };
    let cancel = Arc::new(AtomicBool::new(false));
    let rxs = match st.engine.submit(checked.requests, cancel.clone(), None) {
        Ok(r) => r,
        Err(o) => return overloaded(o.capacity),
    };
    match wait_all(rxs, cancel).await {
        Ok(mut imgs) => {
            let img = imgs.remove(0);
            let mut h = HeaderMap::new();
            h.insert(header::CONTENT_TYPE, HeaderValue::from_static("image/png"));
            for (k, v) in [
                ("x-mold-seed", img.seed.to_string()),
                ("x-mold-replica", img.replica.to_string()),
                ("x-mold-seconds", format!("{:.3}", img.seconds)),
            ] {
                if let Ok(v) = HeaderValue::from_str(&v) {
                    h.insert(k, v);
                }
            }
            (h, img.png).into_response()
        }
        Err(e) => failed(&e),
    }
}

fn progress_event(p: &mold_pipeline::Progress) -> SseEvent {
    use mold_pipeline::Progress as P;
    let data = match p {
        P::Step {
            index,
            steps,
            seconds,
            ..
        } => {
            json!({"stage": "step", "index": index, "steps": steps, "seconds": seconds, "line": p.to_string()})
        }
        P::Encoded { component, .. } => {
            json!({"stage": "encoded", "component": component, "line": p.to_string()})
        }
        P::Decoded { .. } => json!({"stage": "decoded", "line": p.to_string()}),
        _ => json!({"stage": "note", "line": p.to_string()}),
    };
    SseEvent::default().event("progress").data(data.to_string())
}

async fn generate_stream(
    State(st): App,
    headers: HeaderMap,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Response {
    if let Some(r) = deny(&st, &headers) {
        return r;
    }
    let body = match body_or_refusal(&st, body) {
        Ok(b) => b,
        Err(r) => return *r,
    };
    let checked = match generate_checked(&st, &body) {
        Ok(c) => c,
        Err(r) => return refused(&st, r),
    };
    let cancel = Arc::new(AtomicBool::new(false));
    let (etx, mut erx) = mpsc::unbounded_channel::<Event>();
    let mut rxs = match st
        .engine
        .submit(checked.requests, cancel.clone(), Some(etx))
    {
        Ok(r) => r,
        Err(o) => return overloaded(o.capacity),
    };
    let done = rxs.remove(0);
    let (tx, rx) = mpsc::unbounded_channel::<Result<SseEvent, Infallible>>();
    tokio::spawn(async move {
        let guard = CancelOnDrop::new(cancel);
        let queued = SseEvent::default()
            .event("queued")
            .data(json!({"stage": "queued"}).to_string());
        if tx.send(Ok(queued)).is_err() {
            return;
        }
        // Progress until the request is done (its ticket, holding the sender, dropped).
        while let Some(Event::Progress(p)) = erx.recv().await {
            if tx.send(Ok(progress_event(&p))).is_err() {
                return; // the client went away: the guard cancels
            }
        }
        let last = match done.await {
            Ok(Ok(img)) => SseEvent::default().event("image").data(
                json!({
                    "b64_json": base64::engine::general_purpose::STANDARD.encode(&img.png),
                    "seed": img.seed,
                    "width": img.width,
                    "height": img.height,
                })
                .to_string(),
            ),
            Ok(Err(e)) => SseEvent::default()
                .event("error")
                .data(json!({"message": e}).to_string()),
            Err(_) => SseEvent::default().event("error").data(
                json!({"message": "the server stopped before the image was made"}).to_string(),
            ),
        };
        let _ = tx.send(Ok(last));
        guard.disarm();
    });
    Sse::new(tokio_stream::wrappers::UnboundedReceiverStream::new(rx)).into_response()
}
