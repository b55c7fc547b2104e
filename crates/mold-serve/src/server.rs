//! Starting and stopping: check the options and bind first (a bad address fails before
//! any weight loads), load the engine, serve until told to stop, then drain: stop
//! accepting, let every admitted request finish and its client get its answer, stop the
//! workers.
//!
//! Connections go through hyper directly (axum's router as the service), so each is
//! bounded: `max_connections` at once (a permit per connection, held for its life; one
//! more is answered 503 and closed), its request header within `header_timeout` (hyper's
//! header read timer, which also bounds a kept-alive connection's idle time), and every
//! write within `write_timeout` of the client last reading (tokio-io-timeout).

use crate::engine::{Engine, StartError};
use crate::http::{router, AppState};
use crate::options::{Deployment, OptionsError, ServeOptions};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::sync::Semaphore;

/// Why the server did not start or stopped badly.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Options(#[from] OptionsError),
    #[error("--listen {addr}: cannot bind: {source}; pick a free port or another address")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Start(#[from] StartError),
    #[error("the HTTP server failed: {0}")]
    Io(#[from] std::io::Error),
}

/// How a drained server ended.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    pub ok: u64,
    pub cancelled: u64,
    pub failed: u64,
}

fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("mold-http")
        .enable_all()
        .build()
}

/// A loaded server, bound, not yet serving.
struct Loaded {
    listener: std::net::TcpListener,
    state: Arc<AppState>,
}

type Log = Arc<dyn Fn(String) + Send + Sync>;

fn load(deploy: &Deployment, opts: &ServeOptions, log: Log) -> Result<Loaded, ServeError> {
    opts.check()?;
    let listener = std::net::TcpListener::bind(opts.listen).map_err(|source| ServeError::Bind {
        addr: opts.listen,
        source,
    })?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let engine = Engine::start(deploy, opts, log)?;
    Ok(Loaded {
        listener,
        state: Arc::new(AppState {
            engine,
            opts: opts.clone(),
            model: deploy.model.clone(),
            addr,
            connections: Arc::new(Semaphore::new(opts.max_connections)),
        }),
    })
}

/// What a connection beyond `max_connections` gets before it is closed.
fn busy(max: usize) -> Vec<u8> {
    let body = format!(
        "{{\"error\":{{\"message\":\"too many connections: this server takes {max} at once (--max-connections); retry later\",\"type\":\"server_error\",\"code\":503}}}}\n"
    );
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

async fn serve_until(
    l: Loaded,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<Summary, ServeError> {
    let listener = tokio::net::TcpListener::from_std(l.listener)?;
    let engine = l.state.engine.clone();
    let opts = l.state.opts.clone();
    let permits = l.state.connections.clone();
    let app = router(l.state);
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(opts.header_timeout)
        .keep_alive(true);
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            _ = &mut shutdown => break,
            r = listener.accept() => match r {
                Ok((stream, _)) => stream,
                // Out of file descriptors and the like: the connection is gone; wait a
                // moment rather than spin.
                Err(_) => {
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            // Into an empty send buffer: never blocks. Then closed.
            let _ = stream.try_write(&busy(opts.max_connections));
            continue;
        };
        let _ = stream.set_nodelay(true);
        let mut io = tokio_io_timeout::TimeoutStream::new(stream);
        io.set_write_timeout(Some(opts.write_timeout));
        let conn = http.serve_connection(
            TokioIo::new(Box::pin(io)),
            TowerToHyperService::new(app.clone()),
        );
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
            drop(permit);
        });
    }
    // Nothing new is admitted from here; what was admitted runs to the end and its
    // connection gets its answer before the connections close.
    drop(listener);
    engine.close();
    graceful.shutdown().await;
    let e = engine.clone();
    tokio::task::spawn_blocking(move || e.join())
        .await
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    use crate::metrics::Outcome;
    Ok(Summary {
        ok: engine.metrics.requests(Outcome::Ok),
        cancelled: engine.metrics.requests(Outcome::Cancelled),
        failed: engine.metrics.requests(Outcome::Failed),
    })
}

/// Serves in the foreground until SIGTERM or ctrl-c, then drains. `log` sees a line per
/// component loaded and when it listens.
pub fn run(deploy: &Deployment, opts: &ServeOptions, log: Log) -> Result<Summary, ServeError> {
    let loaded = load(deploy, opts, log.clone())?;
    let addr = loaded.listener.local_addr()?;
    log(format!(
        "listening on http://{addr} ({} replica{}, queue {}, encoder pool {})",
        loaded.state.engine.replica_count(),
        if loaded.state.engine.replica_count() == 1 {
            ""
        } else {
            "s"
        },
        opts.queue,
        if opts.encoder_pool { "on" } else { "off" }
    ));
    let rt = runtime()?;
    let log2 = log.clone();
    rt.block_on(serve_until(loaded, async move {
        signal().await;
        log2("shutting down: finishing the requests in flight".into());
    }))
}

/// SIGTERM or ctrl-c.
async fn signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = ctrl_c => {}
                }
            }
            Err(_) => ctrl_c.await,
        }
    }
    #[cfg(not(unix))]
    ctrl_c.await;
}

/// A server on a thread of its own (tests, embedding): [`Handle::shutdown`] drains it.
pub struct Handle {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<Summary, ServeError>>>,
    engine: Arc<Engine>,
}

impl Handle {
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// Stops accepting, finishes what was admitted, and returns how it went.
    pub fn shutdown(mut self) -> Result<Summary, ServeError> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        match self.thread.take().map(|t| t.join()) {
            Some(Ok(r)) => r,
            Some(Err(_)) => Err(ServeError::Io(std::io::Error::other(
                "the server thread panicked",
            ))),
            None => Ok(Summary::default()),
        }
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Loads and starts a server on a background thread (`opts.listen` may have port 0).
pub fn spawn(deploy: &Deployment, opts: &ServeOptions) -> Result<Handle, ServeError> {
    spawn_logged(deploy, opts, Arc::new(|_| {}))
}

/// [`spawn`], with `log` hearing what [`run`]'s does (loads, failures with their cause).
pub fn spawn_logged(
    deploy: &Deployment,
    opts: &ServeOptions,
    log: Log,
) -> Result<Handle, ServeError> {
    let loaded = load(deploy, opts, log)?;
    let addr = loaded.listener.local_addr()?;
    let engine = loaded.state.engine.clone();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let rt = runtime()?;
    let thread = std::thread::Builder::new()
        .name("mold-serve".into())
        .spawn(move || {
            rt.block_on(serve_until(loaded, async move {
                let _ = stopped.await;
            }))
        })?;
    Ok(Handle {
        addr,
        stop: Some(stop),
        thread: Some(thread),
        engine,
    })
}
