//! `wgpar chat --model M`: an interactive chat in the terminal, on any strategy. Each line
//! read is a user message; the reply streams as it is generated. `/reset` forgets the
//! conversation, `/exit` (or the end of input) leaves. Ctrl-C stops a reply (its text so far
//! stays in the history); at the prompt, or pressed twice, it ends the program.

use std::io::BufRead;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

use clap::Args;
use wgpar::chat::{ChatLimits, Conversation, Stop, DEFAULT_REPLY_TOKENS};
use wgpar::generate::Finish;
use wgpar::model::hf::TextTokenizer;
use wgpar::parallel::Engine;
use wgpar::{Result, WgparError};

use super::options::{DeviceArgs, MemoryArgs, ModelArgs, RunArgs, StrategyArgs, TextArgs};

/// Options of `wgpar chat`.
#[derive(Args, Clone, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    devices: DeviceArgs,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    strategy: StrategyArgs,
    #[command(flatten)]
    memory: MemoryArgs,
    #[command(flatten)]
    text: TextArgs,
    /// Most tokens of one reply (default 256, or half the context if that is less); the
    /// history is trimmed so that a whole reply fits --max-seq.
    #[arg(long, value_name = "TOKENS")]
    gen: Option<usize>,
    /// Pace transfers and collectives to a host profile's links, or to ALPHA_US:BETA_GBPS.
    #[arg(long, value_name = "PROFILE|ALPHA_US:BETA_GBPS")]
    pace: Option<String>,
    /// A system message that opens the conversation (kept when turns are dropped or reset).
    #[arg(long, value_name = "TEXT")]
    system: Option<String>,
    /// A Jinja chat template file, over the checkpoint's own.
    #[arg(long, value_name = "FILE")]
    chat_template: Option<PathBuf>,
    /// Print each rendered prompt and each reply's timings on stderr.
    #[arg(long)]
    verbose: bool,
}

impl ChatArgs {
    /// The options as `run`'s, one sequence at a time, for the checks and the engine that
    /// text generation shares with `run --prompt`.
    fn as_run(&self) -> RunArgs {
        RunArgs {
            devices: self.devices.clone(),
            model: self.model.clone(),
            strategy: self.strategy.clone(),
            batch: 1,
            prompt_len: 1,
            gen: self.gen.unwrap_or(DEFAULT_REPLY_TOKENS),
            trace: None,
            pace: self.pace.clone(),
            device_timestamps: "off".into(),
            inject_fault: None,
            logits_out: None,
            memory: self.memory.clone(),
            text: self.text.clone(),
        }
    }
}

/// Set when Ctrl-C asks the reply in progress to stop.
static CANCEL: AtomicBool = AtomicBool::new(false);
/// Whether a reply is in progress (Ctrl-C stops it rather than the program).
static REPLYING: AtomicBool = AtomicBool::new(false);

/// SIGINT: stops the reply in progress; at the prompt, or a second time, exits (status 130,
/// as a shell reports an interrupted program). Only async-signal-safe calls here.
extern "C" fn on_interrupt(_: libc::c_int) {
    if REPLYING.load(Ordering::SeqCst) && !CANCEL.swap(true, Ordering::SeqCst) {
        return;
    }
    // SAFETY: write(2) and _exit(2) are async-signal-safe; the buffer is a static.
    unsafe {
        libc::write(2, b"\n".as_ptr().cast(), 1);
        libc::_exit(130);
    }
}

fn catch_interrupts() {
    let handler: extern "C" fn(libc::c_int) = on_interrupt;
    // SAFETY: the handler only touches atomics and async-signal-safe calls.
    unsafe {
        libc::signal(libc::SIGINT, handler as libc::sighandler_t);
    }
}

/// Checks the options, loads the model and its template, then chats until `/exit`, the end
/// of input or Ctrl-C at the prompt.
pub fn run(args: &ChatArgs) -> Result<()> {
    let run_args = args.as_run();
    run_args.strategy.choice().check_options()?;
    run_args.choice().check_syntax()?;
    if args.text.prompt.is_some() {
        return Err(WgparError::unsupported(
            "--prompt does not apply to chat: type each message at the prompt".into(),
        ));
    }
    let sampling = super::text::check_options(&run_args)?;
    let config = args.model.choice().config()?;
    let (tokenizer, template) = (
        args.text.tokenizer.as_deref(),
        args.chat_template.as_deref(),
    );
    let side = args
        .model
        .choice()
        .text_side(&config, tokenizer, template)?;
    let template = side.template.ok_or_else(|| {
        WgparError::unsupported(format!(
            "model '{}' has no chat template (tokenizer_config.json's chat_template, \
             chat_template.jinja or a GGUF's tokenizer.chat_template): pass one with \
             --chat-template FILE",
            config.name
        ))
    })?;
    let limits = ChatLimits::for_reply(args.gen, config.max_seq)?;
    let weights = args.model.choice().weights(&config)?;
    let shape = (limits.max_seq - limits.reply_tokens, limits.reply_tokens);
    let mut engine = super::text::open_engine(&run_args, weights, sampling, shape)?.engine;
    let mut session = Session {
        engine: engine.as_mut(),
        tokenizer: &side.tokenizer,
        eos: &side.eos,
        conversation: Conversation::new(template, args.system.as_deref(), limits),
        verbose: args.verbose,
    };
    catch_interrupts();
    eprintln!("chat: /reset clears the conversation, /exit (or Ctrl-D) leaves");
    session.repl()
}

/// One chat in the terminal.
struct Session<'a> {
    engine: &'a mut dyn Engine,
    tokenizer: &'a TextTokenizer,
    eos: &'a [u32],
    conversation: Conversation,
    verbose: bool,
}

impl Session<'_> {
    /// Reads lines until `/exit` or the end of input, answering each message.
    fn repl(&mut self) -> Result<()> {
        let mut lines = std::io::stdin().lock().lines();
        loop {
            out!("> ")?;
            let Some(line) = lines.next() else {
                outln!()?;
                return Ok(());
            };
            let line = line.map_err(|source| WgparError::Io {
                path: "stdin".into(),
                source,
            })?;
            match line.trim() {
                "" => {}
                "/exit" => return Ok(()),
                "/reset" => {
                    self.conversation.reset();
                    eprintln!("conversation cleared");
                }
                text if text.starts_with('/') => {
                    eprintln!("unknown command '{text}': /reset or /exit")
                }
                text => self.answer(text)?,
            }
        }
    }

    /// Streams the reply to `text`; a message that cannot fit is reported, not fatal.
    fn answer(&mut self, text: &str) -> Result<()> {
        let prompt = match self.conversation.prompt(self.tokenizer, text) {
            Ok(prompt) => prompt,
            Err(e @ WgparError::ResourceLimit { .. }) => {
                eprintln!("error: {e}");
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        if prompt.dropped_turns > 0 {
            eprintln!(
                "dropped the {} oldest turn(s) to fit the context (--max-seq)",
                prompt.dropped_turns
            );
        }
        if self.verbose {
            eprintln!("prompt: {:?}", prompt.text);
        }
        let stop = Stop {
            eos: self.eos,
            cancel: Some(&CANCEL),
        };
        CANCEL.store(false, Ordering::SeqCst);
        REPLYING.store(true, Ordering::SeqCst);
        let done =
            (self.conversation).reply(self.engine, self.tokenizer, &prompt, stop, &mut |t| {
                out!("{t}")
            });
        REPLYING.store(false, Ordering::SeqCst);
        let done = done?;
        outln!()?;
        if done.finish == Finish::Cancelled {
            eprintln!("reply stopped");
        }
        if self.verbose {
            eprintln!(
                "{} tokens, {:.1} tokens/s",
                done.ids.len(),
                done.tokens_per_s()
            );
        }
        Ok(())
    }
}
