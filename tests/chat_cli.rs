//! `wgpar chat` driven as a user drives it: lines on stdin, replies on stdout, notes and the
//! rendered prompts (`--verbose`) on stderr, Ctrl-C as SIGINT. The model is a small synthetic
//! checkpoint with a word tokenizer (`tN` is token N) and a chat template, or a preset with
//! `--chat-template`; each reply is checked against `run --prompt` on the rendered prompt.

mod common;
mod hf_support;

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use wgpar::chat::{trim_turns, ChatLimits, Conversation};
use wgpar::model::hf::TextTokenizer;
use wgpar::server::{ChatTemplate, Message};

/// Longest a test waits for the chat to reach a point.
const LIMIT: Duration = Duration::from_secs(240);

/// A running `wgpar chat`, its output gathered as it comes; killed (by its PID) on drop.
struct Chat {
    child: Child,
    stdin: Option<ChildStdin>,
    out: Arc<Mutex<String>>,
    err: Arc<Mutex<String>>,
}

fn gather(mut from: impl Read + Send + 'static) -> Arc<Mutex<String>> {
    let text = Arc::new(Mutex::new(String::new()));
    let into = text.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 256];
        while let Ok(n @ 1..) = from.read(&mut buf) {
            into.lock()
                .unwrap()
                .push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    });
    text
}

impl Chat {
    fn start(args: &[&str]) -> Chat {
        let mut child = Command::new(env!("CARGO_BIN_EXE_wgpar"))
            .arg("chat")
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let out = gather(child.stdout.take().unwrap());
        let err = gather(child.stderr.take().unwrap());
        let stdin = child.stdin.take();
        Chat {
            child,
            stdin,
            out,
            err,
        }
    }

    fn send(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().unwrap();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
    }

    fn out(&self) -> String {
        self.out.lock().unwrap().clone()
    }

    fn err(&self) -> String {
        self.err.lock().unwrap().clone()
    }

    /// Waits until `ready` holds of (stdout, stderr).
    fn wait_for(&self, what: &str, ready: impl Fn(&str, &str) -> bool) {
        let start = Instant::now();
        while !ready(&self.out(), &self.err()) {
            assert!(
                start.elapsed() < LIMIT,
                "no {what} within {LIMIT:?}; stdout {:?}, stderr {:?}",
                self.out(),
                self.err()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Closes stdin (unless `keep_open`) and waits for the exit.
    fn finish(&mut self, keep_open: bool) -> ExitStatus {
        if !keep_open {
            self.stdin = None;
        }
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                // Let the readers drain the pipes.
                std::thread::sleep(Duration::from_millis(100));
                return status;
            }
            assert!(start.elapsed() < LIMIT, "chat did not exit: {}", self.err());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn interrupt(&self) {
        // SAFETY: kill(2) on our own child's PID.
        let rc = unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGINT) };
        assert_eq!(rc, 0);
    }
}

impl Drop for Chat {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The replies on stdout: what follows each `> ` prompt marker, up to its line's end.
fn replies(out: &str) -> Vec<String> {
    out.split("> ")
        .skip(1)
        .filter_map(|turn| turn.split_once('\n').map(|(reply, _)| reply.to_string()))
        .filter(|reply| !reply.is_empty())
        .collect()
}

/// The rendered prompts `--verbose` prints on stderr.
fn prompts(err: &str) -> Vec<String> {
    err.lines()
        .filter_map(|l| l.strip_prefix("prompt: "))
        .map(|quoted| serde_json::from_str(quoted).expect("a quoted prompt"))
        .collect()
}

/// `run --prompt TEXT` on `model`: the continuation it prints (greedy).
fn run_prompt(model: &str, text: &str, gen: usize) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_wgpar"))
        .args(["run", "--model", model, "--prompt", text])
        .args(["--gen", &gen.to_string()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    let rest = stdout
        .strip_prefix(text)
        .expect("run prints the prompt first");
    rest.trim_end_matches('\n').to_string()
}

fn path(dir: &Path) -> &str {
    dir.to_str().unwrap()
}

/// Each message gets a reply, generated from the whole conversation rendered by the
/// checkpoint's template (the same text `run --prompt` continues identically); `/reset`
/// forgets it, keeping the system message; `/exit` ends with status 0.
#[test]
fn turns_keep_history_reset_and_exit() {
    let (dir, _) = hf_support::chat_checkpoint("chat-turns");
    let mut chat = Chat::start(&[
        "--model",
        path(&dir),
        "--gen",
        "6",
        "--system",
        "t11",
        "--verbose",
    ]);
    for line in ["t7 t8", "t9", "/reset", "t3", "/exit"] {
        chat.send(line);
    }
    let status = chat.finish(true);
    assert!(status.success(), "{status:?}: {}", chat.err());
    let (out, err) = (chat.out(), chat.err());
    let replies = replies(&out);
    let prompts = prompts(&err);
    assert_eq!(replies.len(), 3, "one reply per message: {out:?}");
    assert_eq!(prompts.len(), 3, "{err}");
    assert_eq!(prompts[0], "t2 t4 t11 t4 t7 t8 t5");
    let first = replies[0].trim();
    assert!(!first.is_empty());
    assert_eq!(
        prompts[1],
        format!("t2 t4 t11 t4 t7 t8 t4 {first} t4 t9 t5"),
        "the second prompt holds the first turn"
    );
    assert_eq!(
        prompts[2], "t2 t4 t11 t4 t3 t5",
        "/reset keeps only the system"
    );
    assert!(err.contains("conversation cleared"), "{err}");
    for (prompt, reply) in prompts.iter().zip(&replies) {
        let expected = run_prompt(path(&dir), prompt, 6);
        assert_eq!(reply, &expected, "the reply to {prompt:?}");
    }
}

/// With a small --max-seq, the oldest turns go (the system message stays) and stderr says
/// so; a message that cannot fit even alone is refused, and the chat goes on.
#[test]
fn history_trimmed_to_context() {
    let (dir, _) = hf_support::chat_checkpoint("chat-trim");
    // Prompt 1: t2 t4 t11 t4 t7 t5 (6) + 6 reply tokens fit 20; prompt 2 with turn 1 is
    // 6 + 2 + up to 6 + 3 = up to 17, + 6 > 20: turn 1 must go.
    let args = ["--model", path(&dir), "--gen", "6", "--max-seq", "20"];
    let mut chat = Chat::start(&[&args[..], &["--system", "t11", "--verbose"]].concat());
    let long = vec!["t9"; 14].join(" ");
    for line in ["t7", "t8", &long, "t3"] {
        chat.send(line);
    }
    let status = chat.finish(false);
    assert!(status.success(), "{status:?}: {}", chat.err());
    let (out, err) = (chat.out(), chat.err());
    let prompts = prompts(&err);
    assert_eq!(prompts.len(), 3, "{err}");
    assert_eq!(prompts[1], "t2 t4 t11 t4 t8 t5", "turn 1 dropped");
    assert!(err.contains("dropped the 1 oldest turn"), "{err}");
    assert!(err.contains("exceed the context of 20 tokens"), "{err}");
    // The refused message left no trace: the last prompt holds turn 2 or nothing before it.
    assert!(prompts[2].ends_with("t4 t3 t5") && !prompts[2].contains("t9"));
    assert!(prompts[2].starts_with("t2 t4 t11"), "{}", prompts[2]);
    assert_eq!(replies(&out).len(), 3, "{out:?}");
}

/// Ctrl-C during a long reply stops it (its text stays in the history) and the chat answers
/// the next message; Ctrl-C at the prompt ends the program (status 130).
#[test]
fn ctrl_c_stops_the_reply_not_the_chat() {
    let dir = hf_support::scratch("chat-ctrl-c");
    let template = dir.join("chat.jinja");
    std::fs::write(&template, hf_support::CHAT_TEMPLATE).unwrap();
    // A preset: no end token, so the reply runs its whole length unless stopped.
    let mut chat = Chat::start(&[
        "--model",
        "tiny-gpt2",
        "--chat-template",
        path(&template),
        "--max-seq",
        "3000",
        "--gen",
        "2900",
        "--verbose",
    ]);
    chat.send("t7");
    chat.wait_for("reply text", |out, _| out.len() > "> ".len() + 8);
    chat.interrupt();
    chat.wait_for("stopped reply", |_, err| err.contains("reply stopped"));
    let partial = replies(&chat.out())[0].trim().to_string();
    let words = partial.split_whitespace().count();
    assert!((1..2900).contains(&words), "{words} words");
    chat.send("t9");
    chat.wait_for("second prompt", |_, err| prompts(err).len() == 2);
    // The preset has no BOS text: its prompts start with the template's space.
    let second = prompts(&chat.err())[1].trim().to_string();
    // The partial reply is history; the long reply's room may have dropped it again.
    assert!(
        second == format!("t4 t7 t4 {partial} t4 t9 t5") || second == "t4 t9 t5",
        "{second}"
    );
    chat.wait_for("second reply", |out, _| {
        out.matches("> ").count() == 3 && out.ends_with("> ")
    });
    assert_eq!(replies(&chat.out()).len(), 2);
    chat.interrupt();
    let status = chat.finish(true);
    assert_eq!(status.code(), Some(130), "{}", chat.err());
}

/// Tensor and pipeline parallel chats give the single device's greedy replies.
#[test]
fn any_strategy_same_replies() {
    let dir = hf_support::scratch("chat-strategies");
    let template = dir.join("chat.jinja");
    std::fs::write(&template, hf_support::CHAT_TEMPLATE).unwrap();
    let chat = |strategy: &[&str]| {
        let base = ["--model", "tiny-llama", "--chat-template", path(&template)];
        let mut chat = Chat::start(&[&base[..], &["--gen", "6"], strategy].concat());
        chat.send("t7 t8");
        chat.send("t9");
        let status = chat.finish(false);
        assert!(status.success(), "{strategy:?}: {}", chat.err());
        replies(&chat.out())
    };
    let single = chat(&[]);
    assert_eq!(single.len(), 2, "{single:?}");
    for strategy in [["--strategy", "tp"], ["--strategy", "pp"]] {
        let replies = chat(&[&strategy[..], &["--virtual", "2"]].concat());
        assert_eq!(replies, single, "{strategy:?}");
    }
}

/// The released SmolLM2-135M-Instruct GGUF chats through the template in its metadata, and
/// its second answer needs the first turn ("And of Italy?").
#[test]
fn released_model_chats_through_its_gguf_template() {
    let model = common::smollm2_gguf();
    let mut chat = Chat::start(&[
        "--model",
        model.to_str().unwrap(),
        "--gen",
        "12",
        "--max-seq",
        "256",
        "--verbose",
    ]);
    chat.send("What is the capital of France?");
    chat.send("And of Italy?");
    let status = chat.finish(false);
    assert!(status.success(), "{status:?}: {}", chat.err());
    let (replies, prompts) = (replies(&chat.out()), prompts(&chat.err()));
    assert_eq!(
        (replies.len(), prompts.len()),
        (2, 2),
        "{replies:?} {prompts:?}"
    );
    assert!(
        prompts[0].starts_with("<|im_start|>system\n"),
        "{}",
        prompts[0]
    );
    assert!(prompts[1].contains(&format!("<|im_start|>assistant\n{}<|im_end|>", replies[0])));
    assert!(replies[0].contains("Paris"), "{replies:?}");
    assert!(replies[1].contains("Rome"), "{replies:?}");
}

/// A model without a chat template is refused before anything loads, pointing at
/// --chat-template; so are a reply as long as the context and --prompt.
#[test]
fn refusals() {
    let refuse = |args: &[&str], expect: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_wgpar"))
            .arg("chat")
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}: {err}");
        for e in expect {
            assert!(err.contains(e), "{args:?}: {err}");
        }
    };
    refuse(
        &["--model", "tiny-gpt2"],
        &["no chat template", "--chat-template"],
    );
    let (dir, _) = hf_support::chat_checkpoint("chat-refuse");
    std::fs::remove_file(dir.join("tokenizer_config.json")).unwrap();
    refuse(
        &["--model", path(&dir)],
        &["no chat template", "--chat-template"],
    );
    let template = dir.join("chat.jinja");
    std::fs::write(&template, hf_support::CHAT_TEMPLATE).unwrap();
    let with = ["--model", path(&dir), "--chat-template", path(&template)];
    refuse(&[&with[..], &["--gen", "96"]].concat(), &["--gen 96"]);
    refuse(&[&with[..], &["--prompt", "t1"]].concat(), &["--prompt"]);
}

fn message(role: &str, content: &str) -> Message {
    Message::text(role, content)
}

fn listed(messages: &[Message]) -> Vec<String> {
    messages
        .iter()
        .map(|m| format!("{}:{}", m.role, m.content))
        .collect()
}

/// The trimming rule: whole turns go, oldest first; the system message and the new
/// question stay; once only they are left and still too long, it gives up.
#[test]
fn trim_rule_drops_oldest_turns() {
    let mut messages = vec![
        message("system", "s"),
        message("user", "a"),
        message("assistant", "aa"),
        message("user", "b"),
        message("assistant", "bb"),
        message("user", "c"),
    ];
    let chars = |m: &[Message]| m.iter().map(|m| m.content.len()).sum::<usize>();
    let mut all = messages.clone();
    assert_eq!(
        trim_turns(&mut all, |m| Ok(chars(m) <= 9)).unwrap(),
        Some(0)
    );
    assert_eq!(all, messages);
    assert_eq!(
        trim_turns(&mut messages, |m| Ok(chars(m) <= 5)).unwrap(),
        Some(1)
    );
    assert_eq!(
        listed(&messages),
        ["system:s", "user:b", "assistant:bb", "user:c"]
    );
    assert_eq!(
        trim_turns(&mut messages, |m| Ok(chars(m) <= 2)).unwrap(),
        Some(1)
    );
    assert_eq!(listed(&messages), ["system:s", "user:c"]);
    assert_eq!(
        trim_turns(&mut messages, |m| Ok(chars(m) <= 1)).unwrap(),
        None
    );
    assert_eq!(listed(&messages), ["system:s", "user:c"]);
    let mut bare = vec![
        message("user", "x"),
        message("assistant", "y"),
        message("user", "z"),
    ];
    assert_eq!(
        trim_turns(&mut bare, |m| Ok(m.len() == 1)).unwrap(),
        Some(1)
    );
    assert_eq!(listed(&bare), ["user:z"]);
}

/// A conversation's prompts leave room for a whole reply: tokens counted by the word
/// tokenizer against the limits, turns dropped by the rule, a message too long taken back.
#[test]
fn conversation_prompt_fits_context() {
    let template = ChatTemplate::new(hf_support::CHAT_TEMPLATE, "t2", "t0").unwrap();
    let tokenizer = TextTokenizer::word_level(64).unwrap();
    let limits = ChatLimits {
        max_seq: 14,
        reply_tokens: 4,
    };
    let mut chat = Conversation::new(template, Some("t11"), limits);
    let first = chat.prompt(&tokenizer, "t7 t8").unwrap();
    assert_eq!(first.text, "t2 t4 t11 t4 t7 t8 t5");
    assert_eq!((first.ids.len(), first.dropped_turns), (7, 0));
    // With the first turn, 11 tokens + 4 exceed 14: the first turn goes.
    let second = chat.prompt(&tokenizer, "t9 t9 t9").unwrap();
    assert_eq!(second.text, "t2 t4 t11 t4 t9 t9 t9 t5");
    assert_eq!((second.ids.len(), second.dropped_turns), (8, 1));
    // 12 tokens alone: refused, and the history is as it was.
    let too_long = chat.prompt(&tokenizer, &["t9"; 7].join(" ")).unwrap_err();
    assert!(
        too_long.to_string().contains("context of 14 tokens"),
        "{too_long}"
    );
    assert_eq!(listed(chat.messages()), ["system:t11", "user:t9 t9 t9"]);
    chat.reset();
    assert_eq!(listed(chat.messages()), ["system:t11"]);
    assert_eq!(chat.prompt(&tokenizer, "t7 t8").unwrap().text, first.text);
}
