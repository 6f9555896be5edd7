//! Prefix caching over the KV slots, shared by the benchmark scheduler and the server's engine
//! loop: a new prompt reuses the KV that another sequence already computed for its longest
//! cached prefix and prefills only the rest (llama-server's `cache_prompt`, vLLM's automatic
//! prefix caching).
//!
//! The KV cache stays slot-contiguous (one slot per sequence). The cache indexes what each slot
//! holds in fixed blocks of [`DEFAULT_BLOCK`] tokens, each full block keyed by a chained hash
//! (the previous block's key and this block's tokens), so one key names a whole prefix; a hit
//! is confirmed by comparing the tokens, never by the hash alone. A new prompt takes:
//! - a *free* slot that already holds its longest prefix, in place and with no copy; there
//!   the match is token-granular (the longest common prefix, as llama-server reuses a slot);
//! - otherwise the least-recently-used free slot, with a [`KvCopy`] of the matched whole
//!   blocks from a slot that holds them (running or free), made on the device before the step.
//!
//! At least one prompt token is always left to prefill: the step that completes a prompt must
//! produce its logits. Blocks are registered once their data is on the device: a prompt's
//! when the step completing its prefill finished, the generated tokens' when the sequence
//! leaves. When a slot is given to a new request, what it holds beyond the reused prefix is
//! dropped from the index (it will be overwritten).
//!
//! Not paged yet: blocks are not evicted one by one. Free slots are taken least-recently-used,
//! so unreferenced blocks are evicted LRU together with their slot; a prefix shared by running
//! sequences is copied into each slot, not referenced. The kernels and engines do address the
//! KV through per-slot block tables (`BatchStep::kv_tables`), but this cache leaves every slot
//! on its identity table; an allocator that shares blocks by reference is left undone.
//!
//! A request may keep its prompt out of the cache's reuse (llama-server's `cache_prompt:
//! false`) or salt it (vLLM's `cache_salt`): a salted prompt's blocks are keyed under its salt,
//! so it reuses only KV computed for prompts with the same salt, and others never reuse its
//! KV ([`Lookup`]).
//!
//! Ordering: a copy's source is never overwritten before the copy runs, because a slot's
//! blocks are registered only after the step that wrote them completed, copies run at the
//! start of the step that carries them, and engines run steps in submission order on every
//! device, stage and rank; a step submitted later that overwrites the source runs after it.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};

use serde::Serialize;

use crate::parallel::KvCopy;
use crate::trace::SpanId;

/// Tokens per cached block when none is given.
pub const DEFAULT_BLOCK: usize = 16;

/// Whether a model's KV slots can be copied on the device: an f16 cache of an odd
/// `max_seq x head_dim` puts every other slot at a 2-byte offset, which a buffer copy cannot
/// address (the engines refuse such a copy). Without, prefixes are reused in place only.
pub fn copies_fit(config: &crate::model::ModelConfig) -> bool {
    (config.max_seq * config.head_dim).is_multiple_of(2)
}

/// How one prompt may use the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Lookup {
    /// Look for a cached prefix (llama-server's `cache_prompt`); `false` prefills the whole
    /// prompt (its KV is still cached for later prompts of its namespace).
    pub skip: bool,
    /// The namespace its blocks are keyed under: 0 for the shared one, a salt's hash for a
    /// salted request (vLLM's `cache_salt`), which shares KV only with the same salt.
    pub namespace: u64,
}

impl Lookup {
    /// The shared namespace, looked up.
    pub const SHARED: Lookup = Lookup {
        skip: false,
        namespace: 0,
    };

    /// A request's use: salted by `salt` if given (never the shared namespace), looked up
    /// unless `reuse` is false.
    pub fn new(reuse: bool, salt: Option<&str>) -> Self {
        let namespace = salt.map_or(0, |salt| {
            let mut h = DefaultHasher::new();
            salt.hash(&mut h);
            // 0 is the shared namespace: a salt never lands there.
            h.finish().max(1)
        });
        Self {
            skip: !reuse,
            namespace,
        }
    }
}

/// What the cache did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PrefixStats {
    /// Prompts looked up.
    pub queries: u64,
    /// Prompts that reused some cached KV.
    pub hits: u64,
    /// Of those, prompts whose prefix was copied from another slot (the others reused
    /// their slot's KV in place).
    pub copies: u64,
    /// Prompt tokens looked up.
    pub query_tokens: u64,
    /// Prompt tokens reused: not prefilled.
    pub reused_tokens: u64,
}

impl PrefixStats {
    /// Share of the looked-up prompt tokens that were reused (0 when none were looked up).
    pub fn token_hit_rate(&self) -> f64 {
        self.reused_tokens as f64 / self.query_tokens.max(1) as f64
    }
}

/// A slot given to a new prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Taken {
    /// The slot.
    pub slot: usize,
    /// Prompt tokens its KV holds already (after `copy`): prefill starts there.
    pub reused: usize,
    /// The copy that brings the reused prefix into the slot, made before the step's layers.
    pub copy: Option<KvCopy>,
    /// The step that wrote the reused prefix (a step that uses it waits for it).
    pub written_by: SpanId,
}

/// One KV slot as the cache sees it.
#[derive(Debug, Clone)]
struct Slot {
    /// Tokens whose KV the slot holds at positions `0..len` (registered ones only).
    tokens: Vec<u32>,
    /// Key of each full block of `tokens` (all in the index).
    keys: Vec<u64>,
    /// A running sequence owns it.
    owned: bool,
    /// When it was last freed (for least-recently-used).
    used: u64,
    /// The step that wrote its registered tokens.
    span: SpanId,
    /// The namespace of the request that last took it: its blocks are keyed under it.
    namespace: u64,
}

/// The prefix cache over a run's KV slots; with it off, only the free list.
#[derive(Debug, Clone)]
pub struct PrefixCache {
    block: usize,
    enabled: bool,
    /// Whether the engine makes [`KvCopy`]s; without, only in-place reuse.
    copies: bool,
    slots: Vec<Slot>,
    /// Block key to the slots holding that block (and so the whole prefix it ends).
    index: HashMap<u64, Vec<usize>>,
    tick: u64,
    stats: PrefixStats,
}

/// The chained key of the block `tokens` after the block keyed `prev`.
fn chain(prev: u64, tokens: &[u32]) -> u64 {
    let mut h = DefaultHasher::new();
    prev.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

/// The chained key of each full block of `tokens`, in `namespace`.
fn block_keys(tokens: &[u32], block: usize, namespace: u64) -> Vec<u64> {
    let mut prev = namespace;
    (tokens.chunks_exact(block))
        .map(|b| {
            prev = chain(prev, b);
            prev
        })
        .collect()
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl PrefixCache {
    /// A cache over `slots` free slots, blocks of [`DEFAULT_BLOCK`] tokens; `enabled: false`
    /// reuses nothing.
    pub fn new(slots: usize, enabled: bool) -> Self {
        Self {
            block: DEFAULT_BLOCK,
            enabled,
            copies: true,
            slots: (0..slots)
                .map(|_| Slot {
                    tokens: Vec::new(),
                    keys: Vec::new(),
                    owned: false,
                    used: 0,
                    span: SpanId::NONE,
                    namespace: 0,
                })
                .collect(),
            index: HashMap::new(),
            tick: 0,
            stats: PrefixStats::default(),
        }
    }

    /// The same with blocks of `block` tokens (at least 1).
    pub fn with_block(mut self, block: usize) -> Self {
        self.block = block.max(1);
        self
    }

    /// Whether the engine copies KV between slots; without, a prefix is reused only in place.
    pub fn with_copies(mut self, copies: bool) -> Self {
        self.copies = copies;
        self
    }

    /// Whether it reuses anything.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Whether a prompt of `len` tokens, once its prefill completed, can lend its whole blocks
    /// from its running slot to another prompt with the same tokens and `lookup` (the choices
    /// of an `n > 1` request): the cache is on and copies between slots, `lookup` looks, and
    /// a whole block comes before the prompt's last token (which is always prefilled).
    pub fn shares(&self, len: usize, lookup: Lookup) -> bool {
        self.enabled && self.copies && !lookup.skip && len > self.block
    }

    /// Free slots.
    pub fn free(&self) -> usize {
        self.slots.iter().filter(|s| !s.owned).count()
    }

    /// What it did so far.
    pub fn stats(&self) -> PrefixStats {
        self.stats
    }

    /// Gives `prompt` a free slot with the longest cached prefix it can reuse (at most all but
    /// its last token), in the shared namespace; `None` when no slot is free.
    pub fn take(&mut self, prompt: &[u32]) -> Option<Taken> {
        self.take_with(prompt, Lookup::SHARED)
    }

    /// [`Self::take`] as `lookup` says: in its namespace, or without looking.
    pub fn take_with(&mut self, prompt: &[u32], lookup: Lookup) -> Option<Taken> {
        let lru = self.lru()?;
        let (slot, reused, copy) = if self.enabled && !lookup.skip && !prompt.is_empty() {
            self.stats.queries += 1;
            self.stats.query_tokens += prompt.len() as u64;
            self.best(prompt, lru, lookup.namespace)
        } else {
            (lru, 0, None)
        };
        let written_by = match copy {
            Some(c) => self.slots[c.from].span,
            None if reused > 0 => self.slots[slot].span,
            None => SpanId::NONE,
        };
        // Whatever the slot held beyond what is reused will be overwritten.
        // (Only a slot of the prompt's own namespace is reused in place, so what stays is
        // keyed under the namespace it takes.)
        self.truncate(slot, if copy.is_some() { 0 } else { reused });
        let s = &mut self.slots[slot];
        s.owned = true;
        s.namespace = lookup.namespace;
        if reused > 0 {
            self.stats.hits += 1;
            self.stats.copies += u64::from(copy.is_some());
            self.stats.reused_tokens += reused as u64;
        }
        Some(Taken {
            slot,
            reused,
            copy,
            written_by,
        })
    }

    /// The least-recently-used free slot (the lowest index among equals).
    fn lru(&self) -> Option<usize> {
        (self.slots.iter().enumerate())
            .filter(|(_, s)| !s.owned)
            .min_by_key(|(i, s)| (s.used, *i))
            .map(|(i, _)| i)
    }

    /// The slot, reused tokens and copy for `prompt`: a free slot holding the longest match in
    /// place, else `lru` with a copy of the matched whole blocks.
    fn best(&self, prompt: &[u32], lru: usize, namespace: u64) -> (usize, usize, Option<KvCopy>) {
        let limit = prompt.len() - 1;
        let (blocks, holders) = self.longest_blocks(&prompt[..limit], namespace);
        let in_place = (self.slots.iter().enumerate())
            .filter(|(_, s)| !s.owned && s.namespace == namespace)
            .map(|(i, s)| (i, common_prefix(&s.tokens, &prompt[..limit])))
            .max_by_key(|&(i, n)| (n, std::cmp::Reverse(self.slots[i].used)));
        let matched = blocks * self.block;
        match in_place {
            Some((slot, n)) if n > 0 && n >= matched => (slot, n, None),
            _ if matched > 0 && self.copies => {
                let from = holders[0];
                let copy = KvCopy {
                    from,
                    to: lru,
                    tokens: matched,
                };
                (lru, matched, Some(copy))
            }
            _ => (lru, 0, None),
        }
    }

    /// The most whole blocks of `tokens` some slot of `namespace` holds, and the slots
    /// holding them.
    fn longest_blocks(&self, tokens: &[u32], namespace: u64) -> (usize, Vec<usize>) {
        let b = self.block;
        let (mut prev, mut found, mut holders) = (namespace, 0, Vec::new());
        for (i, block) in tokens.chunks_exact(b).enumerate() {
            let key = chain(prev, block);
            let range = i * b..(i + 1) * b;
            // The hash names a candidate; its tokens decide.
            let now: Vec<usize> = (self.index.get(&key).into_iter().flatten())
                .copied()
                .filter(|&s| {
                    let t = &self.slots[s].tokens;
                    self.slots[s].namespace == namespace
                        && t.len() >= range.end
                        && t[..range.end] == tokens[..range.end]
                })
                .collect();
            if now.is_empty() {
                break;
            }
            (prev, found, holders) = (key, i + 1, now);
        }
        (found, holders)
    }

    /// Keeps the first `len` tokens of `slot`, dropping its blocks beyond from the index.
    fn truncate(&mut self, slot: usize, len: usize) {
        let keep = len / self.block;
        let s = &mut self.slots[slot];
        s.tokens.truncate(len);
        for key in s.keys.drain(keep.min(s.keys.len())..) {
            if let Some(holders) = self.index.get_mut(&key) {
                holders.retain(|&h| h != slot);
                if holders.is_empty() {
                    self.index.remove(&key);
                }
            }
        }
    }

    /// `slot`'s KV holds `tokens` (the step `span` wrote the last of them, and has completed):
    /// their full blocks join the index.
    pub fn register(&mut self, slot: usize, tokens: &[u32], span: SpanId) {
        if !self.enabled {
            return;
        }
        let same = common_prefix(&self.slots[slot].tokens, tokens);
        self.truncate(slot, same);
        let s = &mut self.slots[slot];
        s.tokens.extend_from_slice(&tokens[same..]);
        s.span = span;
        let keys = block_keys(&s.tokens, self.block, s.namespace);
        for (i, &key) in keys.iter().enumerate().skip(s.keys.len()) {
            debug_assert_eq!(i, s.keys.len());
            s.keys.push(key);
            self.index.entry(key).or_default().push(slot);
        }
    }

    /// The sequence in `slot` left; its KV holds `tokens` (written by the completed step
    /// `span`). The slot is free, the most recently used.
    pub fn release(&mut self, slot: usize, tokens: &[u32], span: SpanId) {
        self.register(slot, tokens, span);
        self.tick += 1;
        let s = &mut self.slots[slot];
        s.owned = false;
        s.used = self.tick;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(range: std::ops::Range<u32>) -> Vec<u32> {
        range.collect()
    }

    fn span(n: u64) -> SpanId {
        SpanId(n)
    }

    #[test]
    fn keys_chain_over_blocks() {
        let a = block_keys(&ids(0..12), 4, 0);
        assert_eq!(a.len(), 3, "only full blocks");
        // The same block after a different prefix has another key.
        let mut other = ids(0..12);
        other[0] = 99;
        let b = block_keys(&other, 4, 0);
        assert_ne!(a[0], b[0]);
        assert_ne!(a[2], b[2], "a key names the whole prefix");
        assert_eq!(a, block_keys(&ids(0..14), 4, 0));
    }

    #[test]
    fn a_free_slot_with_the_prefix_is_taken_in_place_up_to_the_last_token() {
        let mut c = PrefixCache::new(3, true).with_block(4);
        let t = c.take(&ids(0..10)).unwrap();
        assert_eq!((t.slot, t.reused, t.copy), (0, 0, None));
        c.register(0, &ids(0..10), span(1));
        c.release(0, &ids(0..13), span(2));
        // Token-granular in place: 11 of the slot's 13 tokens match.
        let mut p = ids(0..11);
        p.push(500);
        let t = c.take(&p).unwrap();
        assert_eq!(
            (t.slot, t.reused, t.copy, t.written_by),
            (0, 11, None, span(2))
        );
        c.release(0, &p, span(3));
        // Never the whole prompt: the same prompt again prefills its last token.
        let t = c.take(&p).unwrap();
        assert_eq!((t.slot, t.reused), (0, 11));
        let s = c.stats();
        assert_eq!(
            (s.queries, s.hits, s.query_tokens, s.reused_tokens),
            (3, 2, 34, 22)
        );
        assert_eq!(s.copies, 0);
    }

    #[test]
    fn a_running_slots_blocks_are_copied_into_the_least_recently_used() {
        let mut c = PrefixCache::new(3, true).with_block(4);
        let a = c.take(&ids(0..10)).unwrap();
        // Not registered before its prefill completed: nothing to reuse yet.
        assert_eq!(c.take(&ids(0..10)).unwrap().reused, 0);
        c.register(a.slot, &ids(0..10), span(7));
        let t = c.take(&ids(0..9)).unwrap();
        assert_eq!(t.slot, 2);
        assert_eq!(
            t.copy,
            Some(KvCopy {
                from: 0,
                to: 2,
                tokens: 8
            })
        );
        assert_eq!((t.reused, t.written_by), (8, span(7)));
        assert_eq!(c.stats().copies, 1);
        assert_eq!(c.take(&ids(0..9)), None, "no slot free");
        // Without copies, only in place.
        let mut c = PrefixCache::new(2, true).with_block(4).with_copies(false);
        let a = c.take(&ids(0..10)).unwrap();
        c.register(a.slot, &ids(0..10), span(1));
        assert_eq!(c.take(&ids(0..10)).unwrap().reused, 0);
    }

    #[test]
    fn free_slots_are_evicted_least_recently_used_and_reuse_drops_the_rest() {
        let mut c = PrefixCache::new(3, true).with_block(4);
        for s in 0..3 {
            let base = 100 * s as u32;
            assert_eq!(c.take(&ids(base..base + 9)).unwrap().slot, s);
        }
        // Freed in the order 1, 0, 2: the next unmatched prompt takes 1, then 0, then 2.
        for s in [1, 0, 2] {
            let base = 100 * s as u32;
            c.release(s, &ids(base..base + 9), span(s as u64));
        }
        let order: Vec<usize> = (0..3)
            .map(|i| c.take(&ids(1000 + i..1010 + i)).unwrap().slot)
            .collect();
        assert_eq!(order, vec![1, 0, 2]);
        // Slot 1 now holds the new prompt's prefix only: its old blocks are gone.
        let mut c = PrefixCache::new(2, true).with_block(4);
        c.take(&ids(0..12)).unwrap();
        c.release(0, &ids(0..12), span(1));
        let mut p = ids(0..6);
        p.extend([77, 78, 79, 80]);
        assert_eq!(c.take(&p).unwrap().reused, 6);
        // Blocks 0..4 stay (reused), 4..8 and 8..12 are dropped: another prompt with the old
        // tokens finds only the first block, and copies it from the running slot.
        let t = c.take(&ids(0..12)).unwrap();
        assert_eq!(t.reused, 4);
        assert_eq!(t.copy.map(|c| (c.from, c.tokens)), Some((0, 4)));
    }

    #[test]
    fn a_hash_match_with_other_tokens_is_no_hit_and_off_reuses_nothing() {
        let mut c = PrefixCache::new(2, true).with_block(4);
        c.take(&ids(0..8)).unwrap();
        c.register(0, &ids(0..8), span(1));
        // Corrupt the slot's tokens behind the index's back: the key still points at it.
        c.slots[0].tokens[1] = 42;
        assert_eq!(c.take(&ids(0..9)).unwrap().reused, 0);
        let mut off = PrefixCache::new(1, false);
        off.take(&ids(0..8)).unwrap();
        off.release(0, &ids(0..8), span(1));
        assert_eq!(off.take(&ids(0..8)).unwrap().reused, 0);
        assert_eq!(off.stats(), PrefixStats::default());
    }

    #[test]
    fn salted_prompts_share_only_within_their_salt_and_skipping_reuses_nothing() {
        let mut c = PrefixCache::new(3, true).with_block(4);
        let salted = Lookup::new(true, Some("alice"));
        assert_ne!(salted.namespace, 0);
        c.take_with(&ids(0..12), salted).unwrap();
        c.release(0, &ids(0..12), span(1));
        // Neither the shared namespace nor another salt sees alice's blocks.
        let t = c.take(&ids(0..12)).unwrap();
        assert_eq!((t.slot, t.reused), (1, 0));
        c.release(1, &ids(0..12), span(2));
        let bob = Lookup::new(true, Some("bob"));
        assert_eq!(c.take_with(&ids(0..12), bob).unwrap().reused, 0);
        c.release(2, &ids(100..112), span(3));
        // The same salt finds them, in place.
        let t = c.take_with(&ids(0..12), salted).unwrap();
        assert_eq!((t.slot, t.reused, t.copy), (0, 11, None));
        // Skipping looks nothing up, though slot 1 holds the prompt.
        let t = c.take_with(&ids(0..12), Lookup::new(false, None)).unwrap();
        assert_eq!(t.reused, 0);
        assert_eq!(c.stats().queries, 4);
    }

    #[test]
    fn a_prompt_shares_its_blocks_only_past_one_block_with_copies_and_a_lookup() {
        let c = PrefixCache::new(2, true).with_block(4);
        assert!(c.shares(5, Lookup::SHARED));
        assert!(c.shares(5, Lookup::new(true, Some("alice"))));
        // Its last token is prefilled: 4 tokens leave no whole block to lend.
        assert!(!c.shares(4, Lookup::SHARED));
        assert!(!c.shares(9, Lookup::new(false, None)));
        assert!(!c.clone().with_copies(false).shares(9, Lookup::SHARED));
        assert!(!PrefixCache::new(2, false).shares(99, Lookup::SHARED));
    }
}
