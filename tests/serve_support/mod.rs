//! A `wgpar serve` process for tests: started from a command, ready once it printed its
//! address and `/health` says 200, driven with curl, stopped by PID when dropped.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A running server.
pub struct Server {
    pub child: Child,
    pub port: u16,
    /// Every line it printed on stderr so far.
    pub stderr: Arc<Mutex<Vec<String>>>,
}

impl Server {
    /// Starts `cmd` (a `wgpar serve --port 0 ...`, directly or under mpirun) and waits until
    /// it is healthy, at most `limit`.
    pub fn spawn(mut cmd: Command, limit: Duration) -> Server {
        let mut child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let seen = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("server: {line}");
                if let Some(rest) = line.strip_prefix("listening on http://") {
                    let addr = rest.split_whitespace().next().unwrap_or_default();
                    let port = addr.rsplit(':').next().unwrap().parse::<u16>().unwrap();
                    let _ = tx.send(port);
                }
                seen.lock().unwrap().push(line);
            }
        });
        let port = rx
            .recv_timeout(limit)
            .expect("the server printed no address");
        let server = Server {
            child,
            port,
            stderr: lines,
        };
        let t0 = Instant::now();
        while server.get("/health").0 != 200 {
            assert!(t0.elapsed() < limit, "never healthy");
            std::thread::sleep(Duration::from_millis(200));
        }
        server
    }

    /// curl: (status, body).
    pub fn curl(&self, args: &[&str], path: &str) -> (u16, String) {
        let out = Command::new("curl")
            .args(["-s", "-m", "120", "-w", "\n%{http_code}"])
            .args(args)
            .arg(format!("http://127.0.0.1:{}{path}", self.port))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
        (code.trim().parse().unwrap_or(0), body.to_string())
    }

    pub fn get(&self, path: &str) -> (u16, String) {
        self.curl(&[], path)
    }

    pub fn post(&self, path: &str, body: &str) -> (u16, String) {
        self.curl(&["-H", "Content-Type: application/json", "-d", body], path)
    }

    /// The text of a completion (status 200 asserted).
    pub fn complete(&self, body: &str) -> String {
        let (code, text) = self.post("/v1/completions", body);
        assert_eq!(code, 200, "{body}: {text}");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        v["choices"][0]["text"].as_str().unwrap().to_string()
    }

    /// A gauge or counter of /metrics: the sum over its series (label sets).
    pub fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.get("/metrics");
        metric_in(&text, name).unwrap_or_else(|| panic!("{name} not in /metrics:\n{text}"))
    }

    /// SIGTERM, then the exit status within `limit`.
    pub fn terminate(&mut self, limit: Duration) -> ExitStatus {
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        self.wait(limit)
    }

    /// The exit status within `limit` (panics past it).
    pub fn wait(&mut self, limit: Duration) -> ExitStatus {
        let t0 = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(t0.elapsed() < limit, "still running after {limit:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// The sum of `name`'s series in a Prometheus text exposition; `None` when it has none.
pub fn metric_in(text: &str, name: &str) -> Option<f64> {
    let values: Vec<f64> = text
        .lines()
        .filter(|l| !l.starts_with('#') && l.split(['{', ' ']).next() == Some(name))
        .filter_map(|l| l.rsplit(' ').next()?.trim().parse().ok())
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
