//! The conversation of `wgpar chat`: the messages so far (a system message first, if any),
//! rendered with the model's chat template, trimmed so that the prompt and a whole reply fit
//! the context, and one reply generated at a time, streamed through a callback and kept in
//! the history (a cancelled reply's partial text included).

use std::sync::atomic::AtomicBool;

use crate::error::{Result, WgparError};
use crate::generate::{generate, Generated, Request};
use crate::model::hf::TextTokenizer;
use crate::parallel::Engine;
use crate::server::{ChatTemplate, Message};

/// How much of the context a conversation may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChatLimits {
    /// Context of the engine, tokens (prompt and reply together).
    pub max_seq: usize,
    /// Most tokens of one reply: the prompt leaves room for them.
    pub reply_tokens: usize,
}

/// Most tokens of a reply unless the caller says otherwise (or the context is short).
pub const DEFAULT_REPLY_TOKENS: usize = 256;

impl ChatLimits {
    /// The limits of replies of `gen` tokens (default: [`DEFAULT_REPLY_TOKENS`], at most half
    /// the context) in a context of `max_seq`, checked: a reply must leave a prompt room.
    pub fn for_reply(gen: Option<usize>, max_seq: usize) -> Result<Self> {
        let gen = gen.unwrap_or(DEFAULT_REPLY_TOKENS.min(max_seq / 2).max(1));
        if gen >= max_seq {
            return Err(WgparError::option(
                "--gen",
                format!(
                    "--gen {gen} leaves no room for a prompt in a context of {max_seq} tokens: \
                     lower --gen or raise --max-seq"
                ),
            ));
        }
        Ok(ChatLimits {
            max_seq,
            reply_tokens: gen,
        })
    }
}

/// The next reply's prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct Prompt {
    /// The rendered conversation, ending where the assistant's answer starts.
    pub text: String,
    /// Its token ids.
    pub ids: Vec<u32>,
    /// Oldest turns dropped to make it fit.
    pub dropped_turns: usize,
}

/// A conversation with a model through its chat template.
#[derive(Debug)]
pub struct Conversation {
    template: ChatTemplate,
    messages: Vec<Message>,
    limits: ChatLimits,
}

fn message(role: &str, content: &str) -> Message {
    Message::text(role, content)
}

impl Conversation {
    /// An empty conversation, opened by `system` where given.
    pub fn new(template: ChatTemplate, system: Option<&str>, limits: ChatLimits) -> Self {
        let messages = system.map(|s| message("system", s)).into_iter().collect();
        Self {
            template,
            messages,
            limits,
        }
    }

    /// The messages so far.
    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// Forgets every turn, keeping the system message.
    pub fn reset(&mut self) {
        self.messages
            .truncate(usize::from(has_system(&self.messages)));
    }

    /// Adds the user's message and renders the prompt of the reply, dropping the oldest
    /// turns while it and a whole reply do not fit the context. Where even the message alone
    /// does not fit, the history is left as it was and the error gives the numbers.
    pub fn prompt(&mut self, tokenizer: &TextTokenizer, user: &str) -> Result<Prompt> {
        let before = self.messages.clone();
        self.messages.push(message("user", user));
        let result = self.fit(tokenizer);
        if result.is_err() {
            self.messages = before;
        }
        result
    }

    fn fit(&mut self, tokenizer: &TextTokenizer) -> Result<Prompt> {
        let limits = self.limits;
        let mut last = None;
        let template = &self.template;
        let fitted = trim_turns(&mut self.messages, |messages| {
            let text = template
                .render(messages, true)
                .map_err(WgparError::unsupported)?;
            let ids = tokenizer.encode_plain(&text)?;
            let fits = ids.len() + limits.reply_tokens <= limits.max_seq;
            last = Some((text, ids));
            Ok(fits)
        })?;
        let (text, ids) = last.expect("trim_turns measures at least once");
        match fitted {
            Some(_) if ids.is_empty() => Err(WgparError::unsupported(
                "the chat template rendered a prompt without tokens".into(),
            )),
            Some(dropped_turns) => Ok(Prompt {
                text,
                ids,
                dropped_turns,
            }),
            None => Err(too_long(ids.len(), limits)),
        }
    }

    /// Generates the reply to `prompt` (from [`Self::prompt`]), streaming its text through
    /// `on_text`, and keeps it in the history, however it ended.
    pub fn reply(
        &mut self,
        engine: &mut dyn Engine,
        tokenizer: &TextTokenizer,
        prompt: &Prompt,
        stop: Stop<'_>,
        on_text: &mut dyn FnMut(&str) -> Result<()>,
    ) -> Result<Generated> {
        let mut text = String::new();
        let request = Request {
            ids: &prompt.ids,
            max_new: self.limits.reply_tokens,
            eos: stop.eos,
            cancel: stop.cancel,
        };
        let result = generate(engine, tokenizer, &request, &mut |piece| {
            text.push_str(piece);
            on_text(piece)
        });
        self.messages.push(message("assistant", &text));
        result
    }
}

/// What ends a reply besides its length.
#[derive(Debug, Clone, Copy)]
pub struct Stop<'a> {
    /// The model's end tokens.
    pub eos: &'a [u32],
    /// Set to stop the reply before its next token (Ctrl-C).
    pub cancel: Option<&'a AtomicBool>,
}

fn has_system(messages: &[Message]) -> bool {
    messages.first().is_some_and(|m| m.role == "system")
}

fn too_long(prompt: usize, limits: ChatLimits) -> WgparError {
    let needed = prompt + limits.reply_tokens;
    WgparError::limit(
        "context (tokens)",
        (needed as u64, limits.max_seq as u64),
        format!(
            "this message's prompt of {prompt} tokens and a reply of up to {} tokens exceed \
             the context of {} tokens even with no earlier turns: shorten it, lower --gen or \
             raise --max-seq",
            limits.reply_tokens, limits.max_seq
        ),
    )
}

/// The trimming rule: while `fits` says no, drops the oldest turn (a user message and the
/// replies after it), never a leading system message nor the last user message. Returns
/// the turns dropped, or `None` where nothing more can go and it still does not fit.
pub fn trim_turns(
    messages: &mut Vec<Message>,
    mut fits: impl FnMut(&[Message]) -> Result<bool>,
) -> Result<Option<usize>> {
    let keep = usize::from(has_system(messages));
    let mut dropped = 0;
    loop {
        if fits(messages)? {
            return Ok(Some(dropped));
        }
        let last_user = messages.iter().rposition(|m| m.role == "user");
        let Some(last_user) = last_user.filter(|&i| i > keep) else {
            return Ok(None);
        };
        let next_user = messages[keep + 1..].iter().position(|m| m.role == "user");
        let end = next_user.map_or(last_user, |p| (keep + 1 + p).min(last_user));
        messages.drain(keep..end);
        dropped += 1;
    }
}
