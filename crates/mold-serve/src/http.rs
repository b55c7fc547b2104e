//! The HTTP side (axum): routes; what every request but `/health` passes first (its
//! `Host` must name this server, its `Origin`, if any, an allowed one, its bearer token
//! the server's, a POST's body JSON: [`guard`]); the body read within its size and time;
//! errors as one line in OpenAI's error shape (a failure inside the server says only its
//! request id: the log has the cause); the request deadline; server-sent progress with
//! keep-alive comments; and cancellation when a client goes away or its deadline passes
//! (its handler or event stream is dropped, which sets the request's cancel flag).

use crate::api::{self, Refusal};
use crate::engine::{Engine, Event, Failure, FailureKind, Image, Pending, Refused};
use crate::metrics::Outcome;
use crate::options::{ServeOptions, Stage};
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use base64::Engine as _;
use mold_models::ModelSpec;
use serde_json::json;
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use subtle::ConstantTimeEq;
use tokio::sync::{mpsc, Semaphore};
use tokio::time::Instant;

/// What every handler sees.
pub struct AppState {
    pub engine: Arc<Engine>,
    pub opts: ServeOptions,
    pub model: ModelSpec,
    /// The address the server is bound to (its real port when `--listen` gave 0).
    pub addr: SocketAddr,
    /// One permit per open connection (`max_connections` in all).
    pub connections: Arc<Semaphore>,
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

/// An error about one admitted request: its id in the body and `x-mold-request-id`.
fn error_of(status: StatusCode, kind: &str, message: &str, request: u64) -> Response {
    let body = json!({"error": {"message": message, "type": kind, "code": status.as_u16(), "request_id": request}});
    let mut r = (status, axum::Json(body)).into_response();
    r.headers_mut()
        .insert("x-mold-request-id", HeaderValue::from(request));
    r
}

fn refused(st: &AppState, r: Refusal) -> Response {
    st.engine.metrics.count(Outcome::Rejected, 1);
    let status = StatusCode::from_u16(r.status).unwrap_or(StatusCode::BAD_REQUEST);
    error(status, "invalid_request_error", &r.message)
}

fn not_admitted(r: Refused) -> Response {
    match r {
        Refused::Full { capacity } => error(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            &format!("queue full: {capacity} requests are waiting already; retry later"),
        ),
        Refused::TooMany { n, capacity } => error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            &format!("n: {n} images, more than this server's queue holds ({capacity}); ask for at most {capacity} per request"),
        ),
        Refused::Draining => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "the server is shutting down and takes no new requests; retry on another server or once it is back",
        ),
        Refused::NoReplica => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "no replica can serve: each failed (the server's log says why); restart the server",
        ),
    }
}

fn failed(f: &Failure) -> Response {
    let status = StatusCode::from_u16(f.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    error_of(status, "server_error", &f.message(), f.request)
}

fn timed_out(st: &AppState, request: u64) -> Response {
    error_of(
        StatusCode::GATEWAY_TIMEOUT,
        "timeout_error",
        &timeout_message(st, request),
        request,
    )
}

fn timeout_message(st: &AppState, request: u64) -> String {
    format!(
        "request {request}: not done within {} (the server's --request-timeout), so cancelled; retry later, or ask for fewer steps or images",
        seconds(st.opts.request_timeout)
    )
}

fn seconds(d: Duration) -> String {
    format!("{} s", d.as_secs_f64())
}

/// The routes, behind [`guard`].
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/status", get(status))
        .route("/metrics", get(metrics))
        .route("/v1/images/generations", post(images))
        .route("/v1/generate", post(generate))
        .route("/v1/generate/stream", post(generate_stream))
        .fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(state.clone(), guard))
        .with_state(state)
}

async fn not_found() -> Response {
    error(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        "no such route: POST /v1/images/generations, /v1/generate, /v1/generate/stream; GET /health, /status, /metrics",
    )
}

/// `name` and port of a `Host` header or `HOST[:PORT]`: the name lowercased, without a
/// trailing dot (an IPv6 address keeps its brackets); `None` when malformed.
pub fn split_host(h: &str) -> Option<(String, Option<u16>)> {
    let h = h.trim();
    let (name, port) = if let Some(rest) = h.strip_prefix('[') {
        let (inside, after) = rest.split_once(']')?;
        inside.parse::<std::net::Ipv6Addr>().ok()?;
        let port = match after {
            "" => None,
            p => Some(p.strip_prefix(':')?.parse::<u16>().ok()?),
        };
        (format!("[{inside}]"), port)
    } else {
        match h.rsplit_once(':') {
            Some((n, p)) => (n.to_string(), Some(p.parse::<u16>().ok()?)),
            None => (h.to_string(), None),
        }
    };
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    let ok = !name.is_empty()
        && (name.starts_with('[')
            || name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_'));
    ok.then_some((name, port))
}

/// Whether `host` (a `Host` header, or an origin's host, whose port defaults to
/// `default_port`) names this server: its listen address, a loopback name at its port,
/// or a `--allow-host` entry (without a port: any port).
fn host_ok(st: &AppState, host: &str, default_port: u16) -> bool {
    let Some((name, port)) = split_host(host) else {
        return false;
    };
    let port = port.unwrap_or(default_port);
    for a in &st.opts.allow_hosts {
        if a == "*" {
            return true;
        }
        if let Some((an, ap)) = split_host(a) {
            if an == name && ap.is_none_or(|p| p == port) {
                return true;
            }
        }
    }
    if port != st.addr.port() {
        return false;
    }
    let own = match st.addr.ip() {
        IpAddr::V4(ip) => ip.to_string(),
        IpAddr::V6(ip) => format!("[{ip}]"),
    };
    (name == own && !st.addr.ip().is_unspecified())
        || ["localhost", "127.0.0.1", "[::1]"].contains(&name.as_str())
}

/// The address clients of this machine use, for messages.
fn own_host(st: &AppState) -> String {
    if st.addr.ip().is_unspecified() {
        format!("localhost:{}", st.addr.port())
    } else {
        st.addr.to_string()
    }
}

/// The refusal of a request whose `Host`, `Origin`, bearer token or (a POST's) content
/// type is not right; `None` when all are.
fn admit(st: &AppState, method: &Method, uri: &axum::http::Uri, h: &HeaderMap) -> Option<Response> {
    let host = uri.authority().map(|a| a.as_str().to_string()).or_else(|| {
        h.get(header::HOST)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    });
    let host_good = host.as_deref().is_some_and(|x| host_ok(st, x, 80));
    if !host_good {
        let said = match &host {
            Some(x) => format!("`{}`", x.escape_debug()),
            None => "missing".into(),
        };
        return Some(error(
            StatusCode::MISDIRECTED_REQUEST,
            "invalid_request_error",
            &format!(
                "host: {said} is not this server; send `Host: {}`, or start the server with --allow-host NAME for the name clients use",
                own_host(st)
            ),
        ));
    }
    if let Some(o) = h.get(header::ORIGIN) {
        let text = o.to_str().unwrap_or("").trim_end_matches('/');
        let listed = st
            .opts
            .allow_origins
            .iter()
            .any(|a| a.trim_end_matches('/').eq_ignore_ascii_case(text));
        let own = match text.split_once("://") {
            Some((scheme, host)) if scheme.eq_ignore_ascii_case("http") => host_ok(st, host, 80),
            Some((scheme, host)) if scheme.eq_ignore_ascii_case("https") => host_ok(st, host, 443),
            _ => false,
        };
        if !(listed || own) {
            return Some(error(
                StatusCode::FORBIDDEN,
                "permission_error",
                &format!(
                    "origin: `{}` may not call this server; call it from http://{}, or start the server with --allow-origin ORIGIN",
                    text.escape_debug(),
                    own_host(st)
                ),
            ));
        }
    }
    if let Some(want) = &st.opts.token {
        let got = h
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, t)| t.trim());
        // Compared in constant time (subtle); only the length may show.
        let ok = got.is_some_and(|g| bool::from(g.as_bytes().ct_eq(want.as_bytes())));
        if !ok {
            return Some(error(
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                "authorization: missing or wrong bearer token; send `Authorization: Bearer <token>` with the token in the server's --token-file",
            ));
        }
    }
    if method == Method::POST {
        let ct = h
            .get(header::CONTENT_TYPE)
            .map(|v| v.to_str().unwrap_or("?"))
            .map(|v| {
                v.split(';')
                    .next()
                    .unwrap_or("")
                    .trim()
                    .to_ascii_lowercase()
            });
        if ct.as_deref() != Some("application/json") {
            let said = match &ct {
                Some(c) => format!("`{}`", c.escape_debug()),
                None => "missing".into(),
            };
            return Some(error(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "invalid_request_error",
                &format!("content-type: {said}; send the body as JSON with `Content-Type: application/json`"),
            ));
        }
    }
    None
}

/// What every request but `/health` passes before its handler: [`admit`]. (`/health`
/// answers load balancers and probes whatever host name they use.)
pub async fn guard(State(st): App, req: Request, next: Next) -> Response {
    if req.uri().path() != "/health" {
        if let Some(r) = admit(&st, req.method(), req.uri(), req.headers()) {
            st.engine.metrics.count(Outcome::Rejected, 1);
            return r;
        }
    }
    next.run(req).await
}

async fn health(State(st): App) -> Response {
    let h = st.engine.health();
    let mut body = json!({
        "replicas": h.replicas,
        "serving": h.serving,
        "failed": h.failed,
        "draining": h.draining,
    });
    let problem = if h.draining {
        Some("draining: the server is shutting down")
    } else if h.failed == h.replicas {
        Some("no replica can serve: each failed (the server's log says why); restart the server")
    } else if h.serving == 0 {
        Some("no replica serves now: reloading after a failure")
    } else {
        None
    };
    match problem {
        None => {
            body["status"] = json!("ok");
            axum::Json(body).into_response()
        }
        Some(why) => {
            body["status"] = json!("unavailable");
            body["error"] = json!({"message": why, "type": "server_error", "code": 503});
            (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response()
        }
    }
}

async fn status(State(st): App) -> Response {
    axum::Json(st.engine.status()).into_response()
}

async fn metrics(State(st): App) -> Response {
    let mut g = st.engine.gauges();
    g.connections = st
        .opts
        .max_connections
        .saturating_sub(st.connections.available_permits());
    let text = st.engine.metrics.render(&g);
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4"),
        )],
        text,
    )
        .into_response()
}

/// How much of a body beyond the limit is read (and dropped) before the 413, so that a
/// client still sending it gets the answer rather than a reset connection.
const DRAIN_BYTES: u64 = 1 << 20;

/// The body, whole, within the size and time limits; else one line (413, 408, 400).
async fn read_body(st: &AppState, headers: &HeaderMap, mut body: Body) -> Result<Bytes, Response> {
    use http_body_util::BodyExt;
    let max = st.opts.max_body_bytes;
    let too_large = || {
        refused(
            st,
            Refusal {
                status: 413,
                message: format!("body: larger than this server takes: at most {max} bytes"),
            },
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > max as u64 + DRAIN_BYTES) {
        return Err(too_large());
    }
    // Frames until the end; past the limit, only counted (up to DRAIN_BYTES more).
    let read = async {
        let mut kept = Vec::new();
        let mut seen = 0u64;
        while let Some(frame) = body.frame().await {
            let Ok(data) = frame?.into_data() else {
                continue; // trailers
            };
            seen += data.len() as u64;
            if seen <= max as u64 {
                kept.extend_from_slice(&data);
            } else if seen > max as u64 + DRAIN_BYTES {
                break;
            }
        }
        Ok::<_, axum::Error>((kept, seen))
    };
    match tokio::time::timeout(st.opts.body_timeout, read).await {
        Ok(Ok((kept, seen))) if seen <= max as u64 => Ok(Bytes::from(kept)),
        Ok(Ok(_)) => Err(too_large()),
        Ok(Err(e)) => Err(refused(
            st,
            Refusal {
                status: 400,
                message: format!(
                    "body: could not be read: {}",
                    e.to_string().replace('\n', " ")
                ),
            },
        )),
        Err(_) => Err(refused(
            st,
            Refusal {
                status: 408,
                message: format!(
                    "body: not all of it arrived within {} (the server's --body-timeout); send it at once",
                    seconds(st.opts.body_timeout)
                ),
            },
        )),
    }
}

/// The test hooks' stop before admission (off the async threads: a gate blocks).
async fn before_admission(st: &Arc<AppState>) {
    if st.opts.hooks.active(Stage::Admit) {
        let hooks = st.opts.hooks.clone();
        let _ = tokio::task::spawn_blocking(move || hooks.at(Stage::Admit)).await;
    }
}

/// How waiting for an admission's images ended, short of all of them.
enum Waited {
    Failed(Failure),
    TimedOut { request: u64 },
}

/// Waits for the images of one admission until `deadline`, cancelling them if the
/// client goes away or the deadline passes.
async fn wait_all(
    st: &AppState,
    pending: Vec<Pending>,
    cancel: Arc<AtomicBool>,
    deadline: Instant,
) -> Result<Vec<Image>, Waited> {
    let guard = CancelOnDrop::new(cancel);
    let first = pending.first().map_or(0, |p| p.id);
    let all = async {
        let mut out = Vec::new();
        let mut first_err = None;
        for p in pending {
            match p.rx.await {
                Ok(Ok(img)) => out.push(img),
                Ok(Err(e)) => {
                    first_err.get_or_insert(e);
                }
                Err(_) => {
                    first_err.get_or_insert(Failure {
                        kind: FailureKind::Unavailable,
                        request: p.id,
                    });
                }
            }
        }
        match first_err {
            Some(e) => Err(Waited::Failed(e)),
            None => Ok(out),
        }
    };
    match tokio::time::timeout_at(deadline, all).await {
        Ok(r) => {
            guard.disarm();
            r
        }
        // The guard cancels them; queued ones leave the queue at the next admission.
        Err(_) => {
            st.engine.metrics.timeout();
            Err(Waited::TimedOut { request: first })
        }
    }
}

fn waited(st: &AppState, w: Waited) -> Response {
    match w {
        Waited::Failed(f) => failed(&f),
        Waited::TimedOut { request } => timed_out(st, request),
    }
}

async fn images(State(st): App, headers: HeaderMap, body: Body) -> Response {
    let body = match read_body(&st, &headers, body).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let checked = api::parse::<api::ImagesRequest>(&body)
        .and_then(|r| api::check_images(&r, &st.opts, &st.model, st.engine.plan()));
    let checked = match checked {
        Ok(c) => c,
        Err(r) => return refused(&st, r),
    };
    before_admission(&st).await;
    let cancel = Arc::new(AtomicBool::new(false));
    let deadline = Instant::now() + st.opts.request_timeout;
    let pending = match st.engine.submit(checked.requests, cancel.clone(), None) {
        Ok(p) => p,
        Err(r) => return not_admitted(r),
    };
    match wait_all(&st, pending, cancel, deadline).await {
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
        Err(w) => waited(&st, w),
    }
}

fn generate_checked(st: &AppState, body: &[u8]) -> Result<api::Checked, Refusal> {
    api::parse::<api::GenerateRequest>(body)
        .and_then(|r| api::check_generate(&r, &st.opts, &st.model, st.engine.plan()))
}

async fn generate(State(st): App, headers: HeaderMap, body: Body) -> Response {
    let body = match read_body(&st, &headers, body).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let checked = match generate_checked(&st, &body) {
        Ok(c) => c,
        Err(r) => return refused(&st, r),
    };
    before_admission(&st).await;
    let cancel = Arc::new(AtomicBool::new(false));
    let deadline = Instant::now() + st.opts.request_timeout;
    let pending = match st.engine.submit(checked.requests, cancel.clone(), None) {
        Ok(p) => p,
        Err(r) => return not_admitted(r),
    };
    match wait_all(&st, pending, cancel, deadline).await {
        Ok(mut imgs) => {
            let img = imgs.remove(0);
            let mut h = HeaderMap::new();
            h.insert(header::CONTENT_TYPE, HeaderValue::from_static("image/png"));
            for (k, v) in [
                ("x-mold-seed", img.seed.to_string()),
                ("x-mold-replica", img.replica.to_string()),
                ("x-mold-seconds", format!("{:.3}", img.seconds)),
                ("x-mold-request-id", img.request.to_string()),
                ("server-timing", server_timing(&img)),
            ] {
                if let Ok(v) = HeaderValue::from_str(&v) {
                    h.insert(k, v);
                }
            }
            (h, img.png).into_response()
        }
        Err(w) => waited(&st, w),
    }
}

/// The request's phases as a `Server-Timing` header (W3C Server Timing: milliseconds),
/// what it waited for as `queue` and the whole as `total`.
fn server_timing(img: &Image) -> String {
    let p = img.phases;
    let queue = (img.seconds - p.encode - p.denoise - p.decode - p.png).max(0.0);
    [
        ("queue", queue),
        ("encode", p.encode),
        ("denoise", p.denoise),
        ("decode", p.decode),
        ("png", p.png),
        ("total", img.seconds),
    ]
    .iter()
    .map(|(n, s)| format!("{n};dur={:.1}", s * 1e3))
    .collect::<Vec<_>>()
    .join(", ")
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

fn error_event(message: &str, request: u64, code: u16) -> SseEvent {
    SseEvent::default()
        .event("error")
        .data(json!({"message": message, "request_id": request, "code": code}).to_string())
}

async fn generate_stream(State(st): App, headers: HeaderMap, body: Body) -> Response {
    let body = match read_body(&st, &headers, body).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let mut checked = match generate_checked(&st, &body) {
        Ok(c) => c,
        Err(r) => return refused(&st, r),
    };
    // The stream's progress lines carry each stage's digest: here someone reads them.
    for r in &mut checked.requests {
        r.no_digests = false;
    }
    before_admission(&st).await;
    let cancel = Arc::new(AtomicBool::new(false));
    let deadline = Instant::now() + st.opts.request_timeout;
    let (etx, mut erx) = mpsc::unbounded_channel::<Event>();
    let mut pending = match st
        .engine
        .submit(checked.requests, cancel.clone(), Some(etx))
    {
        Ok(p) => p,
        Err(r) => return not_admitted(r),
    };
    let Pending { id, rx: done } = pending.remove(0);
    let (tx, rx) = mpsc::unbounded_channel::<Result<SseEvent, Infallible>>();
    let st2 = st.clone();
    tokio::spawn(async move {
        let guard = CancelOnDrop::new(cancel);
        let queued = SseEvent::default()
            .event("queued")
            .data(json!({"stage": "queued", "request_id": id}).to_string());
        if tx.send(Ok(queued)).is_err() {
            return;
        }
        let run = async {
            // Progress until the request is done (its ticket, holding the sender, dropped).
            while let Some(Event::Progress(p)) = erx.recv().await {
                if tx.send(Ok(progress_event(&p))).is_err() {
                    return None; // the client went away: the guard cancels
                }
            }
            Some(done.await)
        };
        let last = match tokio::time::timeout_at(deadline, run).await {
            Ok(None) => return,
            Ok(Some(Ok(Ok(img)))) => SseEvent::default().event("image").data(
                json!({
                    "b64_json": base64::engine::general_purpose::STANDARD.encode(&img.png),
                    "seed": img.seed,
                    "width": img.width,
                    "height": img.height,
                    "replica": img.replica,
                    "request_id": img.request,
                })
                .to_string(),
            ),
            Ok(Some(Ok(Err(f)))) => error_event(&f.message(), f.request, f.status()),
            Ok(Some(Err(_))) => {
                let f = Failure {
                    kind: FailureKind::Unavailable,
                    request: id,
                };
                error_event(&f.message(), id, f.status())
            }
            Err(_) => {
                st2.engine.metrics.timeout();
                let _ = tx.send(Ok(error_event(&timeout_message(&st2, id), id, 504)));
                return; // the guard cancels
            }
        };
        let _ = tx.send(Ok(last));
        guard.disarm();
    });
    Sse::new(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
        .keep_alive(KeepAlive::new().interval(st.opts.sse_keep_alive))
        .into_response()
}
