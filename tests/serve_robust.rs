//! `wgpar serve` under hostile traffic and failures (issue 36): stalled connections close
//! within the header timeout while other requests keep their time to first token; the
//! connection cap answers 503; idle kept-alive connections and stalled bodies time out; a panic
//! on the engine thread or in a pipeline stage ends every request with a 500 or an SSE error
//! event and turns /health to 503; stop strings count as finished; the API key from a file or
//! the environment; the Grafana dashboard queries only exported metrics.
//!
//! Raw sockets on 127.0.0.1 for what a client library hides (half a request line, a stalled
//! body); every wait is bounded; servers are stopped by PID (tests/serve_support).

mod common;
mod serve_support;

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;
use serve_support::{metric_in, Server};

/// `wgpar serve --port 0 --model tiny-gpt2 ARGS`, once /health says 200.
fn launch(args: &[&str]) -> Server {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_wgpar"));
    cmd.args(["serve", "--port", "0", "--model", "tiny-gpt2"])
        .args(args);
    Server::spawn(cmd, Duration::from_secs(300))
}

fn connect(port: u16) -> TcpStream {
    let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    s
}

/// A request with `Connection: close`: the raw bytes to send.
fn request(method: &str, path: &str, body: &str, headers: &[&str]) -> String {
    let mut r = format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n");
    for h in headers {
        r.push_str(h);
        r.push_str("\r\n");
    }
    if !body.is_empty() {
        r.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    r.push_str("\r\n");
    r.push_str(body);
    r
}

/// Reads a response to its end (the server closes): (status, whole text).
fn read_all(mut s: TcpStream) -> (u16, String) {
    let mut bytes = Vec::new();
    let _ = s.read_to_end(&mut bytes);
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, text)
}

fn exchange(port: u16, raw: &str) -> (u16, String) {
    let mut s = connect(port);
    s.write_all(raw.as_bytes()).unwrap();
    read_all(s)
}

/// Seconds until `s` is closed by the server (EOF or reset), at most `limit`; `None` if it
/// is still open then.
fn closed_within(s: &mut TcpStream, limit: Duration) -> Option<f64> {
    let t0 = Instant::now();
    let mut buf = [0u8; 512];
    while t0.elapsed() < limit {
        s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        match s.read(&mut buf) {
            Ok(0) => return Some(t0.elapsed().as_secs_f64()),
            Ok(_) => continue,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => return Some(t0.elapsed().as_secs_f64()),
        }
    }
    None
}

/// Time to the first streamed token of a short completion, seconds.
fn ttft(port: u16) -> f64 {
    let body = r#"{"prompt":"t1 t2 t3","max_tokens":8,"stream":true,"ignore_eos":true}"#;
    let t0 = Instant::now();
    let mut s = connect(port);
    s.write_all(request("POST", "/v1/completions", body, &[]).as_bytes())
        .unwrap();
    let (mut seen, mut buf) = (String::new(), [0u8; 4096]);
    while !seen.contains("\"text\":\"") || !seen.contains("data: {") {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "the stream ended before a token: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    let first = t0.elapsed().as_secs_f64();
    let (_, rest) = read_all(s);
    assert!(
        (seen + &rest).contains("data: [DONE]"),
        "a stream did not finish"
    );
    first
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[test]
fn stalled_connections_close_within_the_header_timeout_and_others_keep_their_ttft() {
    let header_s = 2.0;
    let server = launch(&["--header-timeout", "2", "--max-batch", "4"]);
    let port = server.port;
    let before: Vec<f64> = (0..7).map(|_| ttft(port)).collect();
    let opened = Instant::now();
    let mut stalled: Vec<TcpStream> = (0..64)
        .map(|_| {
            let mut s = connect(port);
            s.write_all(b"POST /v1/compl").unwrap();
            s
        })
        .collect();
    let during: Vec<f64> = (0..7).map(|_| ttft(port)).collect();
    let mut closed = Vec::new();
    for s in &mut stalled {
        let left = Duration::from_secs_f64(header_s + 5.0).saturating_sub(opened.elapsed());
        let at = closed_within(s, left).map(|_| opened.elapsed().as_secs_f64());
        closed.push(at.expect("a stalled connection was still open"));
    }
    let (first, last) = (closed[0], closed.iter().copied().fold(0.0, f64::max));
    let (b, d) = (median(before), median(during));
    eprintln!(
        "64 stalled connections closed {first:.2} to {last:.2} s after opening \
         (--header-timeout {header_s}); TTFT median {:.1} ms without them, {:.1} ms with them",
        b * 1e3,
        d * 1e3
    );
    assert_eq!(closed.len(), 64);
    assert!(
        first >= header_s * 0.9,
        "closed before the header timeout: {first}"
    );
    assert!(last <= header_s + 2.0, "closed {last} s after opening");
    // The other requests were served all along, at their usual pace (loose: a shared CPU).
    assert!(
        d <= 5.0 * b + 0.25,
        "TTFT {d} s with stalled connections, {b} s without"
    );
    // And still are.
    assert_eq!(server.get("/health").0, 200);
}

#[test]
fn connections_past_the_cap_get_503_and_idle_ones_close() {
    let server = launch(&[
        "--max-connections",
        "3",
        "--header-timeout",
        "30",
        "--keep-alive-timeout",
        "1",
    ]);
    let port = server.port;
    // A kept-alive connection: one request, then idle; it closes after the keep-alive
    // timeout, long before the header timeout.
    let mut kept = connect(port);
    kept.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut buf = [0u8; 1024];
    let n = kept.read(&mut buf).unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    let idle = closed_within(&mut kept, Duration::from_secs(8)).expect("idle connection open");
    assert!((0.8..=4.0).contains(&idle), "closed after {idle} s idle");
    // A fresh connection that has sent nothing is the header timer's, not the idle one's.
    let holders: Vec<TcpStream> = (0..3).map(|_| connect(port)).collect();
    let mut first = holders[0].try_clone().unwrap();
    assert_eq!(closed_within(&mut first, Duration::from_secs(2)), None);
    // Three connections are open: a fourth is refused, with Retry-After.
    let (status, text) = exchange(port, &request("GET", "/health", "", &[]));
    assert_eq!(status, 503, "{text}");
    assert!(
        text.to_ascii_lowercase().contains("retry-after: 1"),
        "{text}"
    );
    assert!(text.contains("--max-connections"), "{text}");
    drop((holders, first));
    let t0 = Instant::now();
    while exchange(port, &request("GET", "/health", "", &[])).0 != 200 {
        assert!(t0.elapsed() < Duration::from_secs(10), "slots never freed");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_stalled_request_body_fails_within_the_body_timeout() {
    let server = launch(&["--body-timeout", "1", "--header-timeout", "30"]);
    let head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
                Content-Length: 100\r\n\r\n{\"prompt\":";
    let t0 = Instant::now();
    let mut s = connect(server.port);
    s.write_all(head.as_bytes()).unwrap();
    let (status, text) = read_all(s);
    let took = t0.elapsed().as_secs_f64();
    assert!((400..500).contains(&status), "{status}: {text}");
    assert!((0.8..=5.0).contains(&took), "answered after {took} s");
    // A whole body is still served.
    let body = r#"{"prompt":"t1 t2","max_tokens":2}"#;
    assert_eq!(server.post("/v1/completions", body).0, 200);
}

/// Two streamed and two whole requests in flight when the engine fails: each ends with an
/// error (500, or an SSE error event and no `[DONE]`), /health turns 503, and the failures
/// are counted.
fn every_request_sees_the_failure(server: &Server) {
    let port = server.port;
    let body = |stream: bool| {
        format!(r#"{{"prompt":"t1 t2 t3","max_tokens":90,"ignore_eos":true,"stream":{stream}}}"#)
    };
    // Connect all four first, then send at once: all are in flight before the fault.
    let socks: Vec<(bool, TcpStream)> = [true, false, true, false]
        .into_iter()
        .map(|stream| (stream, connect(port)))
        .collect();
    for (stream, s) in &socks {
        let raw = request("POST", "/v1/completions", &body(*stream), &[]);
        (&*s).write_all(raw.as_bytes()).unwrap();
    }
    let mut checked = 0;
    for (stream, s) in socks {
        let (status, text) = read_all(s);
        if stream {
            assert_eq!(status, 200, "{text}");
            assert!(text.contains("data: {\"error\""), "no error event: {text}");
            assert!(
                !text.contains("[DONE]"),
                "a failed stream said [DONE]: {text}"
            );
        } else {
            assert_eq!(status, 500, "{text}");
            assert!(text.contains("the engine failed"), "{text}");
        }
        checked += 1;
    }
    assert_eq!(checked, 4);
    let (code, health) = server.get("/health");
    assert_eq!(code, 503, "{health}");
    assert_eq!(server.metric("wgpar:requests_failed_total"), 4.0);
    let (code, _) = server.post("/v1/completions", r#"{"prompt":"t1","max_tokens":2}"#);
    assert_eq!(code, 503);
}

#[test]
fn a_panic_on_the_engine_thread_ends_every_request_with_an_error() {
    let server = launch(&["--inject-fault", "engine,kind=panic,at=step:40"]);
    every_request_sees_the_failure(&server);
    let log = server.stderr.lock().unwrap().join("\n");
    assert!(log.contains("the engine thread panicked"), "{log}");
}

#[test]
fn a_panic_in_a_pipeline_stage_ends_every_request_with_an_error() {
    let server = launch(&[
        "--strategy",
        "pp",
        "--virtual",
        "2",
        "--inject-fault",
        "stage=1,kind=panic,at=step:40",
    ]);
    every_request_sees_the_failure(&server);
}

/// The value of `name{...finished_reason="REASON"...}` in /metrics.
fn finished(server: &Server, reason: &str) -> f64 {
    let (_, text) = server.get("/metrics");
    let label = format!("finished_reason=\"{reason}\"");
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("wgpar:request_success_total{") && l.contains(&label))
        .collect();
    assert_eq!(lines.len(), 1, "{text}");
    lines[0].rsplit(' ').next().unwrap().parse().unwrap()
}

#[test]
fn requests_ended_by_a_stop_string_count_as_finished() {
    let server = launch(&["--max-batch", "4"]);
    let plain = server.complete(r#"{"prompt":"t7 t8","max_tokens":6,"temperature":0}"#);
    let words: Vec<&str> = plain.split_whitespace().collect();
    assert!(words.len() >= 2, "{plain}");
    let stop = words[1];
    for stream in [false, true] {
        let body = format!(
            r#"{{"prompt":"t7 t8","max_tokens":40,"temperature":0,"stop":["{stop}"],"stream":{stream}}}"#
        );
        let (code, text) = server.post("/v1/completions", &body);
        assert_eq!(code, 200, "{text}");
        assert!(text.contains(r#""finish_reason":"stop""#), "{text}");
    }
    let t0 = Instant::now();
    while finished(&server, "stop") < 2.0 || server.metric("wgpar:kv_slots_used") != 0.0 {
        assert!(t0.elapsed() < Duration::from_secs(30), "never counted");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(finished(&server, "stop"), 2.0);
    assert_eq!(finished(&server, "length"), 1.0);
    assert_eq!(server.metric("wgpar:requests_cancelled_total"), 0.0);
}

#[test]
fn the_api_key_comes_from_one_source_and_metrics_can_be_open() {
    let dir = common::scratch("serve-robust-key");
    let file = dir.join("key");
    std::fs::write(&file, "k-from-file\n").unwrap();
    let server = launch(&["--api-key-file", file.to_str().unwrap()]);
    let models = |auth: &[&str]| exchange(server.port, &request("GET", "/v1/models", "", auth)).0;
    assert_eq!(models(&["Authorization: bearer k-from-file"]), 200);
    assert_eq!(models(&["authorization: BEARER k-from-file"]), 200);
    assert_eq!(models(&["Authorization: Bearer k-from-fil"]), 401);
    assert_eq!(models(&[]), 401);
    assert_eq!(server.get("/metrics").0, 401);
    drop(server);
    // From the environment, with /metrics open.
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_wgpar"));
    cmd.args([
        "serve",
        "--port",
        "0",
        "--model",
        "tiny-gpt2",
        "--metrics-open",
    ])
    .env("WGPAR_API_KEY", "k-from-env");
    let server = Server::spawn(cmd, Duration::from_secs(300));
    let models = |auth: &[&str]| exchange(server.port, &request("GET", "/v1/models", "", auth)).0;
    assert_eq!(models(&["Authorization: Bearer k-from-env"]), 200);
    assert_eq!(models(&[]), 401);
    assert_eq!(server.get("/metrics").0, 200);
    drop(server);
    // Two sources, or an open /metrics without a key: refused by name before loading.
    let refused = |args: &[&str], env: Option<&str>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_wgpar"));
        cmd.args(["serve", "--port", "0", "--model", "tiny-gpt2"])
            .args(args);
        match env {
            Some(k) => cmd.env("WGPAR_API_KEY", k),
            None => cmd.env_remove("WGPAR_API_KEY"),
        };
        let out = cmd.output().unwrap();
        assert!(!out.status.success(), "{args:?} was accepted");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let both = refused(&["--api-key", "x"], Some("y"));
    assert!(both.contains("--api-key and WGPAR_API_KEY"), "{both}");
    let open = refused(&["--metrics-open"], None);
    assert!(open.contains("--metrics-open"), "{open}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Every `wgpar:` metric an `expr` of the dashboard names, with the histogram suffixes.
fn dashboard_metrics(dashboard: &Value, out: &mut Vec<String>) {
    match dashboard {
        Value::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v.as_str()) {
                    ("expr", Some(expr)) => {
                        for part in expr.split("wgpar:").skip(1) {
                            let name: String = part
                                .chars()
                                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                                .collect();
                            out.push(format!("wgpar:{name}"));
                        }
                    }
                    _ => dashboard_metrics(v, out),
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|v| dashboard_metrics(v, out)),
        _ => {}
    }
}

#[test]
fn the_grafana_dashboard_queries_only_exported_metrics() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/grafana-wgpar.json");
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert!(dashboard["panels"]
        .as_array()
        .is_some_and(|p| !p.is_empty()));
    let mut names = Vec::new();
    dashboard_metrics(&dashboard, &mut names);
    names.sort();
    names.dedup();
    let server = launch(&[]);
    server.complete(r#"{"prompt":"t1 t2","max_tokens":3}"#);
    let (_, text) = server.get("/metrics");
    let mut compared = 0;
    for name in &names {
        assert!(
            metric_in(&text, name).is_some(),
            "{name} is not in /metrics:\n{text}"
        );
        assert!(
            text.contains(&format!("{name}{{model_name=\"tiny-gpt2\"")),
            "{name} has no model_name label"
        );
        compared += 1;
    }
    assert!(compared >= 10, "the dashboard queries only {names:?}");
    for cache in ["hits", "queries"] {
        let name = format!("wgpar:prefix_cache_{cache}_total");
        assert!(names.contains(&name), "no prefix-cache panel: {names:?}");
    }
}

#[test]
fn health_says_draining_while_requests_in_flight_finish() {
    let mut server = launch(&["--max-batch", "1", "--shutdown-timeout", "120"]);
    let port = server.port;
    // One slot, four long streams: the last ends well after the signal.
    let body = r#"{"prompt":"t3 t4","max_tokens":90,"ignore_eos":true,"stream":true}"#;
    let streams: Vec<TcpStream> = (0..4)
        .map(|_| {
            let mut s = connect(port);
            s.write_all(request("POST", "/v1/completions", body, &[]).as_bytes())
                .unwrap();
            s
        })
        .collect();
    let t0 = Instant::now();
    while server.metric("wgpar:num_requests_waiting") < 2.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the requests never queued"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    unsafe { libc::kill(server.child.id() as i32, libc::SIGTERM) };
    let t0 = Instant::now();
    let health = loop {
        let (code, text) = exchange(port, &request("GET", "/health", "", &[]));
        if code == 503 {
            break text;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "/health never said draining"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(health.contains("draining"), "{health}");
    let late = r#"{"prompt":"t1","max_tokens":2}"#;
    let (code, text) = exchange(port, &request("POST", "/v1/completions", late, &[]));
    assert_eq!(code, 503, "{text}");
    for s in streams {
        let (code, text) = read_all(s);
        assert_eq!(code, 200, "{text}");
        assert!(text.contains("data: [DONE]"), "{text}");
    }
    let status = server.wait(Duration::from_secs(60));
    assert!(status.success(), "{status:?}");
}

#[test]
fn a_panic_in_a_tensor_parallel_rank_ends_every_request_with_an_error() {
    let server = launch(&[
        "--strategy",
        "tp",
        "--virtual",
        "2",
        "--inject-fault",
        "rank=1,kind=panic,at=step:40",
    ]);
    every_request_sees_the_failure(&server);
}

/// A connection to `port` whose receive buffer is the kernel's smallest (set before connecting,
/// so the window it advertises stays small): a client that will stop reading.
fn connect_small_window(port: u16) -> TcpStream {
    use std::os::fd::FromRawFd;
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
        assert!(fd >= 0);
        let size: libc::c_int = 1024;
        let set = libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            &size as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
        assert_eq!(set, 0);
        let addr = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: port.to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from(std::net::Ipv4Addr::LOCALHOST).to_be(),
            },
            sin_zero: [0; 8],
        };
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        let done = libc::connect(fd, &addr as *const _ as *const libc::sockaddr, len);
        assert_eq!(done, 0, "connect: {}", std::io::Error::last_os_error());
        TcpStream::from_raw_fd(fd)
    }
}

#[test]
fn a_stream_left_unread_is_cancelled_and_frees_its_slot() {
    let server = launch(&[
        "--max-seq",
        "4096",
        "--stream-timeout",
        "1",
        "--max-batch",
        "2",
    ]);
    let mut s = connect_small_window(server.port);
    // Far more events than the socket buffers hold (about 170 bytes each).
    let body = r#"{"prompt":"t1 t2","max_tokens":4000,"ignore_eos":true,"stream":true}"#;
    s.write_all(request("POST", "/v1/completions", body, &[]).as_bytes())
        .unwrap();
    let mut head = [0u8; 64];
    s.read_exact(&mut head).unwrap();
    assert!(head.starts_with(b"HTTP/1.1 200"));
    // The client reads nothing more.
    let t0 = Instant::now();
    while server.metric("wgpar:requests_cancelled_total") < 1.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "the stalled stream was never cancelled"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let t0 = Instant::now();
    while server.metric("wgpar:kv_slots_used") != 0.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "its slot was not freed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // It was cut short, not finished.
    assert!(server.metric("wgpar:generation_tokens_total") < 4000.0);
    assert_eq!(server.metric("wgpar:request_success_total"), 0.0);
    drop(s);
    // The server goes on serving.
    let ok = r#"{"prompt":"t1 t2","max_tokens":3}"#;
    assert_eq!(server.post("/v1/completions", ok).0, 200);
}
