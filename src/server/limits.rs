//! What a connection may hold, and for how long (issue 36): the accept loop over hyper's
//! HTTP/1 connection builder.
//!
//! - A request head must arrive within `header_timeout` (hyper's header-read timer, which
//!   starts when the connection is opened, and again when a kept-alive one waits for its
//!   next request).
//! - A kept-alive connection with no request in flight closes after `keep_alive_timeout`.
//! - A request body that stops arriving for `body_timeout` fails the request (tower-http's
//!   `TimeoutBody`, reset at each piece).
//! - Past `max_connections` open connections, a new one is answered `503` with `Retry-After`
//!   and closed, as uvicorn's `--limit-concurrency` does under vLLM; its head is still read
//!   under `header_timeout`.
//! - A stream whose client stops reading for `stream_timeout` is cancelled ([`Watched`]): the
//!   engine frees its KV slot at the next step boundary.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, Request, Response, StatusCode};
use axum::Router;
use futures_util::Stream;
use http_body::{Body as HttpBody, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tower::ServiceExt;
use tower_http::timeout::TimeoutBody;

use super::batcher::Ending;

/// The connection limits (`serve --header-timeout`, `--keep-alive-timeout`, `--body-timeout`,
/// `--max-connections`, `--stream-timeout`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ConnLimits {
    /// Longest wait for a complete request head.
    pub header_timeout: Duration,
    /// Longest idle time of a kept-alive connection between requests.
    pub keep_alive_timeout: Duration,
    /// Longest wait for the next piece of a request body.
    pub body_timeout: Duration,
    /// Open connections served at once; beyond, 503.
    pub max_connections: usize,
    /// Longest time a streaming client may leave a ready event unread.
    pub stream_timeout: Duration,
}

impl Default for ConnLimits {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(10),
            keep_alive_timeout: Duration::from_secs(5),
            body_timeout: Duration::from_secs(30),
            max_connections: 1024,
            stream_timeout: Duration::from_secs(60),
        }
    }
}

/// Bytes hyper buffers per connection, each way.
const WRITE_BUFFER: usize = 64 * 1024;

/// Each connection's kernel send buffer. Linux otherwise grows it up to 4 MiB, which holds a
/// whole long generation's events unread, so a stalled client would never be seen; token
/// streams need far less (256 KiB per round trip is 2.5 MB/s at 100 ms).
const SEND_BUFFER: u32 = 256 * 1024;

/// The listening socket; accepted connections inherit its send buffer size.
pub fn bind(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    let socket = match addr {
        std::net::SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        std::net::SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket.set_send_buffer_size(SEND_BUFFER)?;
    socket.bind(addr)?;
    socket.listen(1024)
}

/// Accepts and serves connections until `stop` resolves, then waits for the requests in flight
/// on open connections to end (idle ones close at once).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    stop: impl Future<Output = ()>,
) {
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let graceful = GracefulShutdown::new();
    let mut http = http1::Builder::new();
    // hyper buffers up to this much of a response a client is not reading (400 KiB by
    // default) before it stops asking the stream for more; less makes a stalled client
    // visible to the stream watchdog sooner, and caps what it holds. Request heads must fit.
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(WRITE_BUFFER);
    tokio::pin!(stop);
    loop {
        let tcp = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    // Out of file descriptors and the like: wait rather than spin.
                    eprintln!("warning: accepting a connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = &mut stop => break,
        };
        let permit = permits.clone().try_acquire_owned().ok();
        let conn = Connection {
            app: app.clone(),
            limits,
            permit,
        };
        conn.spawn(&http, &graceful, tcp);
    }
    drop(listener);
    graceful.shutdown().await;
}

/// One accepted connection: served by the app when it holds a permit, refused otherwise.
struct Connection {
    app: Router,
    limits: ConnLimits,
    permit: Option<OwnedSemaphorePermit>,
}

impl Connection {
    fn spawn(self, http: &http1::Builder, graceful: &GracefulShutdown, tcp: TcpStream) {
        let _ = tcp.set_nodelay(true);
        let mut http = http.clone();
        let refuse = self.permit.is_none();
        if refuse {
            http.keep_alive(false);
        }
        let idle = Arc::new(Idle::new());
        let (app, body_timeout) = (self.app, self.limits.body_timeout);
        let requests = idle.clone();
        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let (app, requests) = (app.clone(), requests.clone());
            async move {
                if refuse {
                    return Ok::<_, Infallible>(refused());
                }
                let busy = InFlight::begin(requests);
                let req = req.map(|b| Body::new(TimeoutBody::new(body_timeout, b)));
                let response = app.oneshot(req).await?;
                Ok(response.map(|inner| Body::new(Tracked { inner, _busy: busy })))
            }
        });
        let conn = graceful.watch(http.serve_connection(TokioIo::new(tcp), service));
        let (permit, keep_alive) = (self.permit, self.limits.keep_alive_timeout);
        tokio::spawn(async move {
            let _permit = permit;
            tokio::select! {
                // Header timeouts and resets are the client's business, not the log's.
                _ = conn => {}
                // Dropping the connection closes its socket.
                _ = idle.expired(keep_alive) => {}
            }
        });
    }
}

/// The answer to a connection past `--max-connections`.
fn refused() -> Response<Body> {
    let body = r#"{"error":{"message":"too many connections (--max-connections): retry later","type":"server_error","param":null,"code":503}}"#;
    let mut r = Response::new(Body::from(body));
    *r.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
    let h = r.headers_mut();
    h.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// A connection's requests in flight, and when its last one ended.
struct Idle {
    in_flight: AtomicUsize,
    /// `None` until a request has ended: before the first, the header timer governs.
    last_end: Mutex<Option<Instant>>,
}

impl Idle {
    fn new() -> Self {
        Self {
            in_flight: AtomicUsize::new(0),
            last_end: Mutex::new(None),
        }
    }

    /// Resolves once the connection has been idle, after a request, for `limit`.
    async fn expired(&self, limit: Duration) {
        let check = limit.min(Duration::from_secs(1));
        loop {
            let last = *crate::threads::lock(&self.last_end);
            let wait = match last {
                Some(t) if self.in_flight.load(Ordering::SeqCst) == 0 => {
                    limit.saturating_sub(t.elapsed())
                }
                _ => check,
            };
            if wait.is_zero() {
                return;
            }
            tokio::time::sleep(wait.min(check)).await;
        }
    }
}

/// A request in flight on its connection, until its response body is dropped (sent whole, or
/// abandoned).
struct InFlight(Arc<Idle>);

impl InFlight {
    fn begin(idle: Arc<Idle>) -> Self {
        idle.in_flight.fetch_add(1, Ordering::SeqCst);
        Self(idle)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        *crate::threads::lock(&self.0.last_end) = Some(Instant::now());
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A response body that holds its request's [`InFlight`] mark.
struct Tracked {
    inner: Body,
    _busy: InFlight,
}

impl HttpBody for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// An event stream whose client must take each ready event within a time limit: a watchdog
/// task cancels the request (the [`Ending`] of each of its choices) when the stream has handed out an event and has
/// not been asked for the next one for `limit`, which is when the socket no longer drains.
/// A stream waiting for the engine's next token is not stalled.
pub struct Watched<S> {
    inner: Pin<Box<S>>,
    /// When the last event was handed out, while the next has not been asked for.
    handed: Arc<Mutex<Option<Instant>>>,
}

impl<S: Stream + Send + 'static> Watched<S> {
    /// Watches `inner`; a stall of `limit` cancels every one of `endings`. Needs a tokio
    /// runtime.
    pub fn new(inner: S, endings: Vec<Arc<Ending>>, limit: Duration) -> Self {
        let handed = Arc::new(Mutex::new(None));
        tokio::spawn(watchdog(Arc::downgrade(&handed), endings, limit));
        Self {
            inner: Box::pin(inner),
            handed,
        }
    }
}

/// Cancels `endings` once `handed` shows a stall of `limit`; ends with the stream.
async fn watchdog(
    handed: Weak<Mutex<Option<Instant>>>,
    endings: Vec<Arc<Ending>>,
    limit: Duration,
) {
    let check = (limit / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
    loop {
        tokio::time::sleep(check).await;
        let Some(handed) = handed.upgrade() else {
            return;
        };
        let stalled = crate::threads::lock(&handed).is_some_and(|t| t.elapsed() >= limit);
        if stalled {
            endings.iter().for_each(|e| e.cancel());
            return;
        }
    }
}

impl<S: Stream> Stream for Watched<S> {
    type Item = S::Item;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<S::Item>> {
        let polled = self.inner.as_mut().poll_next(cx);
        let handed = matches!(polled, Poll::Ready(Some(_))).then(Instant::now);
        *crate::threads::lock(&self.handed) = handed;
        polled
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;

    #[tokio::test]
    async fn a_stream_left_unread_is_cancelled_and_one_read_is_not() {
        let limit = Duration::from_millis(100);
        let (read, unread) = (Arc::new(Ending::default()), Arc::new(Ending::default()));
        let mut reading = Watched::new(
            futures_util::stream::iter(0..100),
            vec![read.clone()],
            limit,
        );
        let mut stalled = Watched::new(
            futures_util::stream::iter(0..100),
            vec![unread.clone()],
            limit,
        );
        assert_eq!(stalled.next().await, Some(0));
        let t0 = Instant::now();
        let mut got = 0;
        while t0.elapsed() < 4 * limit {
            got += reading.next().await.is_some() as usize;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(got > 10, "{got}");
        assert!(unread.cancelled(), "a stalled stream was not cancelled");
        assert!(!read.cancelled(), "a stream that was read was cancelled");
    }
}
