//! Prefix caching over a paged KV cache, shared by the benchmark scheduler and the server's
//! engine loop: a new prompt reuses the KV that another sequence already computed for its
//! longest cached prefix and prefills only the rest (llama-server's `cache_prompt`, vLLM's
//! automatic prefix caching).
//!
//! The cache is a block allocator. The engines' KV is a pool of physical blocks of
//! [`DEFAULT_BLOCK`] (= [`KV_BLOCK`]) positions, block `b = s * bps + j` (`bps` blocks per
//! slot), and every slot reads its positions through a block table (`BatchStep::kv_tables`).
//! A running sequence owns a slot (its row in the tables) and references one physical block
//! for each logical block it has reached; each block counts its references. When a new
//! prompt takes a slot, the table of its prompt's blocks is sent with the step that carries
//! its first chunk:
//! - the full cached blocks of its longest cached prefix are **referenced** (their count + 1,
//!   no copy), however many running or ended sequences hold them;
//! - a cached block after those whose leading tokens match the prompt's next ones (the partly
//!   filled last block of a chat's previous turn) is **adopted** when nobody references it:
//!   its matching tokens are reused and the rest of it is overwritten; one that someone
//!   references is left alone, and those tokens are prefilled;
//! - its other blocks are fresh: never-cached free blocks first (the slot's own region's when
//!   free), then the least-recently-used cached block nobody references is evicted, one block
//!   at a time.
//!
//! A decode step that takes a sequence into a block it has not reached yet carries its table
//! again with one more fresh block ([`PrefixCache::grow`]), so cached blocks are evicted only
//! when a position needs one. Every sequence references at most `bps` blocks and the pool
//! holds `bps` for every slot, so a sequence always finds its next block.
//!
//! A full cached block is never written again: its sequences write only past it, and a block
//! is adopted (and then written) only with no reference. Cached blocks are found by exact
//! content, not by hash: each cached block records the block it follows (by id and
//! generation; a block's generation changes whenever its content does, which orphans the
//! blocks that followed it) and its tokens, and the lookup walks from a namespace's root
//! through the followers whose tokens equal the prompt's. When a sequence ends, its blocks
//! nobody else references stay cached, least-recently-used order from its last block to its
//! first (so a prefix outlives its tails); its never-written blocks are free again.
//!
//! When `max_seq` is not a multiple of the block, each slot's last logical block is its own
//! region's short block (the engines' rule: only a slot's last block may be short): it is
//! never pooled, shared or cached; positions in it are simply not reused.
//!
//! At least one prompt token is always left to prefill: the step that completes a prompt must
//! produce its logits. Blocks are registered once their data is on the device: a prompt's
//! when the step completing its prefill finished, the generated tokens' when the sequence
//! leaves. With the cache off (`--no-prefix-cache`) no table is ever sent: every slot keeps
//! its identity table, and nothing is shared.
//!
//! A request may keep its prompt out of the cache's reuse (llama-server's `cache_prompt:
//! false`) or salt it (vLLM's `cache_salt`): a salted prompt's blocks are cached under its
//! salt's root, so it reuses only KV computed for prompts with the same salt, and others
//! never reuse its KV ([`Lookup`]).
//!
//! Ordering: a block a step reads was written by a step that completed before it was
//! registered; a fresh, adopted or evicted block has no reference, so no step in flight reads
//! or writes it (a sequence leaves only after its last step completed). [`Taken::deps`]
//! names the steps that wrote or freed the blocks a new sequence uses, for a scheduler that
//! records a timeline.

use std::collections::{BTreeSet, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};

use serde::Serialize;

use crate::kernels::ops::KV_BLOCK;
use crate::model::ModelConfig;
use crate::parallel::SlotTable;
use crate::trace::SpanId;

/// Tokens per cached block when none is given: the engines' KV block.
pub const DEFAULT_BLOCK: usize = KV_BLOCK;

/// Chains of equal cached blocks a lookup follows at most.
const MAX_CHAINS: usize = 64;

/// How one prompt may use the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Lookup {
    /// Look for a cached prefix (llama-server's `cache_prompt`); `false` prefills the whole
    /// prompt (its KV is still cached for later prompts of its namespace).
    pub skip: bool,
    /// The namespace its blocks are cached under: 0 for the shared one, a salt's hash for a
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
    /// Of those, prompts that referenced a block some running sequence held too (the others
    /// reused blocks of ended sequences only).
    pub shared: u64,
    /// Prompt tokens looked up.
    pub query_tokens: u64,
    /// Prompt tokens reused: not prefilled.
    pub reused_tokens: u64,
    /// Cached blocks evicted to give a sequence a fresh block.
    pub evictions: u64,
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
    /// Prompt tokens its blocks hold already: prefill starts there.
    pub reused: usize,
    /// The slot's new block table, for the step that carries its first chunk (`None` with the
    /// cache off: the slot keeps its identity table).
    pub table: Option<SlotTable>,
    /// The steps that wrote its reused blocks or freed its fresh ones (a step that uses them
    /// waits for them); none of [`SpanId::NONE`].
    pub deps: Vec<SpanId>,
}

/// What a cached block follows: a namespace's root, or a block (id, generation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Parent {
    Root(u64),
    Block(usize, u64),
}

/// One physical block as the cache sees it.
#[derive(Debug, Clone)]
struct Block {
    /// Running sequences whose tables name it.
    refs: usize,
    /// Tokens whose KV it holds at its first positions (registered ones only).
    tokens: Vec<u32>,
    /// What it follows, while it is cached (listed under it in `children`).
    parent: Option<Parent>,
    /// Changes whenever its content does: blocks cached after an older one are orphaned.
    gen: u64,
    /// The latest step that wrote or freed it.
    span: SpanId,
    /// When its last reference went (least-recently-used order among cached blocks).
    tick: u64,
}

impl Default for Block {
    fn default() -> Self {
        Self {
            refs: 0,
            tokens: Vec::new(),
            parent: None,
            gen: 0,
            span: SpanId::NONE,
            tick: 0,
        }
    }
}

/// One slot as the cache sees it.
#[derive(Debug, Clone, Default)]
struct Slot {
    /// A running sequence owns it.
    owned: bool,
    /// Its pooled logical blocks' physical blocks (empty with the cache off).
    table: Vec<usize>,
    /// Tokens whose KV its blocks hold at positions `0..len` (registered ones only).
    tokens: Vec<u32>,
    /// The namespace of the request that holds it.
    namespace: u64,
}

/// The prefix cache over a run's KV slots and blocks; with it off, only the free slots.
#[derive(Debug, Clone)]
pub struct PrefixCache {
    block: usize,
    enabled: bool,
    max_seq: usize,
    /// Blocks per slot region.
    bps: usize,
    /// A slot's logical blocks taken from the pool (all but a short last one).
    pooled: usize,
    slots: Vec<Slot>,
    blocks: Vec<Block>,
    /// Pooled blocks that hold nothing cached and nobody references.
    free: BTreeSet<usize>,
    /// Cached blocks nobody references, by (tick, id): the first is evicted first.
    lru: BTreeSet<(u64, usize)>,
    /// The cached blocks following each parent.
    children: HashMap<Parent, Vec<usize>>,
    tick: u64,
    stats: PrefixStats,
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Whether a prefix cached for `config`'s model may be reused: not where sliding-window
/// layers keep a ring ([`ModelConfig::layer_ring`]). A ring holds only its slot's latest
/// window, and no block holds a ring layer's KV; a prompt that reused `L` cached positions
/// would need the ring layers' keys of the window before `L`, which its slot never computed,
/// and recomputing them needs the keys before those in turn (every layer's input depends on
/// the earlier layers' windows), back to position 0. So such a model prefills every prompt
/// whole: the cache is off for it.
pub fn reuses_prefixes(config: &ModelConfig) -> bool {
    config.ring_step().is_none()
}

impl PrefixCache {
    /// The cache an engine running `config`'s model takes: [`new`](Self::new), off where
    /// [`reuses_prefixes`] says the model cannot reuse a prefix.
    pub fn for_model(slots: usize, config: &ModelConfig, enabled: bool) -> Self {
        Self::new(slots, config.max_seq, enabled && reuses_prefixes(config))
    }

    /// A cache over `slots` free slots of `max_seq` positions, blocks of [`DEFAULT_BLOCK`]
    /// tokens; `enabled: false` reuses nothing.
    pub fn new(slots: usize, max_seq: usize, enabled: bool) -> Self {
        let mut c = Self {
            block: DEFAULT_BLOCK,
            enabled,
            max_seq,
            bps: 0,
            pooled: 0,
            slots: vec![Slot::default(); slots],
            blocks: Vec::new(),
            free: BTreeSet::new(),
            lru: BTreeSet::new(),
            children: HashMap::new(),
            tick: 0,
            stats: PrefixStats::default(),
        };
        c.lay_out();
        c
    }

    /// The same with blocks of `block` tokens (at least 1; the engines' is [`KV_BLOCK`]).
    pub fn with_block(mut self, block: usize) -> Self {
        self.block = block.max(1);
        self.lay_out();
        self
    }

    /// Sizes the pool: every pooled block free.
    fn lay_out(&mut self) {
        self.bps = self.max_seq.div_ceil(self.block);
        let short = !self.max_seq.is_multiple_of(self.block);
        self.pooled = self.bps - usize::from(short);
        self.blocks = vec![Block::default(); self.slots.len() * self.bps];
        self.free = (0..self.blocks.len())
            .filter(|b| b % self.bps < self.pooled)
            .collect();
    }

    /// Whether it reuses anything.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Whether a prompt of `len` tokens, once its prefill completed, can lend its whole blocks
    /// to another prompt with the same tokens and `lookup` (the choices of an `n > 1`
    /// request): the cache is on, `lookup` looks, and a whole pooled block comes before the
    /// prompt's last token (which is always prefilled).
    pub fn shares(&self, len: usize, lookup: Lookup) -> bool {
        self.enabled && !lookup.skip && len > self.block && self.pooled > 0
    }

    /// Free slots.
    pub fn free(&self) -> usize {
        self.slots.iter().filter(|s| !s.owned).count()
    }

    /// What it did so far.
    pub fn stats(&self) -> PrefixStats {
        self.stats
    }

    /// Blocks some running sequence references.
    pub fn blocks_in_use(&self) -> usize {
        self.blocks.iter().filter(|b| b.refs > 0).count()
    }

    /// Blocks nobody references that hold cached KV (evicted when fresh ones run out).
    pub fn blocks_cached(&self) -> usize {
        self.lru.len()
    }

    /// Gives `prompt` a free slot with the longest cached prefix it can reuse (at most all but
    /// its last token), in the shared namespace; `None` when no slot is free.
    pub fn take(&mut self, prompt: &[u32]) -> Option<Taken> {
        self.take_with(prompt, Lookup::SHARED)
    }

    /// [`Self::take`] as `lookup` says: in its namespace, or without looking.
    pub fn take_with(&mut self, prompt: &[u32], lookup: Lookup) -> Option<Taken> {
        let slot = self.slots.iter().position(|s| !s.owned)?;
        self.slots[slot].owned = true;
        self.slots[slot].namespace = lookup.namespace;
        if !self.enabled {
            return Some(Taken {
                slot,
                reused: 0,
                table: None,
                deps: Vec::new(),
            });
        }
        let found = if !lookup.skip && !prompt.is_empty() {
            self.stats.queries += 1;
            self.stats.query_tokens += prompt.len() as u64;
            self.longest(prompt, lookup.namespace)
        } else {
            Found::default()
        };
        Some(self.fill(slot, prompt, found))
    }

    /// Gives `slot` the blocks `found` names, then fresh ones; counts the hit.
    fn fill(&mut self, slot: usize, prompt: &[u32], found: Found) -> Taken {
        let mut table = Vec::with_capacity(self.pooled);
        let mut shared = false;
        for &b in &found.full {
            shared |= self.blocks[b].refs > 0;
            self.hold(b);
            table.push(b);
        }
        let mut reused = found.full.len() * self.block;
        if let Some((b, n)) = found.tail {
            self.hold(b);
            self.cut(b, n);
            table.push(b);
            reused += n;
        }
        // Blocks for the whole prompt now; those past it as the sequence reaches them.
        while table.len() < self.pooled.min(prompt.len().div_ceil(self.block)) {
            let b = self.allocate(slot * self.bps + table.len());
            table.push(b);
        }
        if reused > 0 {
            self.stats.hits += 1;
            self.stats.shared += u64::from(shared);
            self.stats.reused_tokens += reused as u64;
        }
        let mut deps: Vec<SpanId> = table.iter().map(|&b| self.blocks[b].span).collect();
        deps.sort();
        deps.dedup();
        deps.retain(|d| !d.is_none());
        let s = &mut self.slots[slot];
        s.tokens = prompt[..reused].to_vec();
        s.table = table;
        let blocks = s.table.iter().map(|&b| b as u32).collect();
        Taken {
            slot,
            reused,
            table: Some(SlotTable { slot, blocks }),
            deps,
        }
    }

    /// The sequence in `slot` is about to hold `len` positions: its table again, with fresh
    /// blocks for the positions its blocks do not reach yet (for the step that writes them),
    /// and the steps that freed those; `None` when it has its blocks (or the cache is off).
    pub fn grow(&mut self, slot: usize, len: usize) -> Option<(SlotTable, Vec<SpanId>)> {
        let want = self.pooled.min(len.div_ceil(self.block));
        if !self.enabled || self.slots[slot].table.len() >= want {
            return None;
        }
        let mut deps = Vec::new();
        while self.slots[slot].table.len() < want {
            let b = self.allocate(slot * self.bps + self.slots[slot].table.len());
            deps.push(self.blocks[b].span);
            self.slots[slot].table.push(b);
        }
        deps.retain(|d| !d.is_none());
        let blocks = self.slots[slot].table.iter().map(|&b| b as u32).collect();
        Some((SlotTable { slot, blocks }, deps))
    }

    /// The longest cached prefix of `prompt` (before its last token) in `namespace`: its full
    /// blocks, and an unreferenced block after them with the number of its leading tokens
    /// that match the prompt's next ones.
    fn longest(&self, prompt: &[u32], namespace: u64) -> Found {
        let limit = (prompt.len() - 1).min(self.pooled * self.block);
        let tokens = &prompt[..limit];
        // Several sequences may have cached the same block (prompts prefilled side by side),
        // each followed by its own: every chain of equal blocks is followed.
        let mut chains: Vec<Vec<usize>> = vec![Vec::new()];
        for chunk in tokens.chunks_exact(self.block) {
            let mut next = Vec::new();
            for chain in &chains {
                let parent = self.parent_after(chain, namespace);
                for &b in self.followers(parent) {
                    if self.blocks[b].tokens == chunk && next.len() < MAX_CHAINS {
                        next.push([chain.as_slice(), &[b]].concat());
                    }
                }
            }
            if next.is_empty() {
                break;
            }
            chains = next;
        }
        let rest = &tokens[chains[0].len() * self.block..];
        // The chain with the longest adoptable block after it (the latest cached among
        // equals).
        let mut best = Found::default();
        let mut best_key = None;
        for chain in chains {
            let parent = self.parent_after(&chain, namespace);
            let tail = (self.followers(parent))
                .filter(|&&b| self.blocks[b].refs == 0)
                .map(|&b| (b, common_prefix(&self.blocks[b].tokens, rest)))
                .filter(|&(_, n)| n > 0)
                .max_by_key(|&(b, n)| (n, self.blocks[b].tick));
            let key = tail.map(|(b, n)| (n, self.blocks[b].tick));
            if best_key.is_none() || key > best_key.flatten() {
                (best, best_key) = (Found { full: chain, tail }, Some(key));
            }
        }
        best
    }

    /// What a block after the blocks `chain` (from `namespace`'s root) follows.
    fn parent_after(&self, chain: &[usize], namespace: u64) -> Parent {
        chain.last().map_or(Parent::Root(namespace), |&b| {
            Parent::Block(b, self.blocks[b].gen)
        })
    }

    /// The cached blocks that follow `parent` now (entries orphaned since are skipped).
    fn followers(&self, parent: Parent) -> impl DoubleEndedIterator<Item = &usize> {
        (self.children.get(&parent).into_iter().flatten())
            .filter(move |&&b| self.blocks[b].parent == Some(parent))
    }

    /// One more reference to `b` (no longer evictable).
    fn hold(&mut self, b: usize) {
        let block = &mut self.blocks[b];
        if block.refs == 0 {
            self.lru.remove(&(block.tick, b));
            self.free.remove(&b);
        }
        block.refs += 1;
    }

    /// Keeps the first `n` tokens of `b` (it will be written past them).
    fn cut(&mut self, b: usize, n: usize) {
        let block = &mut self.blocks[b];
        if block.tokens.len() > n {
            block.tokens.truncate(n);
            block.gen += 1;
        }
    }

    /// A fresh block for a sequence, `own` (its slot region's) if that one is free: a free
    /// block, else the least-recently-used cached one, evicted.
    fn allocate(&mut self, own: usize) -> usize {
        let b = if self.free.remove(&own) {
            own
        } else if let Some(b) = self.free.pop_first() {
            b
        } else {
            let (_, b) = (self.lru.pop_first())
                // Each running sequence references at most `pooled` blocks and the pool
                // holds `pooled` for every slot, so one that needs a block finds one.
                .expect("the block pool holds every slot's blocks");
            self.forget(b);
            self.stats.evictions += 1;
            b
        };
        self.blocks[b].refs = 1;
        b
    }

    /// `b` holds nothing cached any more.
    fn forget(&mut self, b: usize) {
        let block = &mut self.blocks[b];
        block.tokens.clear();
        block.gen += 1;
        if let Some(parent) = block.parent.take() {
            if let Some(list) = self.children.get_mut(&parent) {
                list.retain(|&c| c != b);
                if list.is_empty() {
                    self.children.remove(&parent);
                }
            }
        }
    }

    /// `slot`'s KV holds `tokens` (the step `span` wrote the last of them, and has completed):
    /// the blocks they fill are cached (those in a short last block are not).
    pub fn register(&mut self, slot: usize, tokens: &[u32], span: SpanId) {
        if !self.enabled {
            return;
        }
        let len = tokens.len().min(self.slots[slot].table.len() * self.block);
        let tokens = &tokens[..len];
        let same = common_prefix(&self.slots[slot].tokens, tokens);
        let from = same / self.block;
        for j in from..len.div_ceil(self.block) {
            let b = self.slots[slot].table[j];
            let content = &tokens[j * self.block..len.min((j + 1) * self.block)];
            let block = &mut self.blocks[b];
            if !content.starts_with(&block.tokens) {
                block.gen += 1;
            }
            block.tokens = content.to_vec();
            block.span = block.span.max(span);
            if block.parent.is_none() {
                let parent = match j {
                    0 => Parent::Root(self.slots[slot].namespace),
                    _ => {
                        let p = self.slots[slot].table[j - 1];
                        Parent::Block(p, self.blocks[p].gen)
                    }
                };
                self.blocks[b].parent = Some(parent);
                self.children.entry(parent).or_default().push(b);
            }
        }
        self.slots[slot].tokens = tokens.to_vec();
    }

    /// The sequence in `slot` left; its KV holds `tokens` (written by the completed step
    /// `span`). The slot is free; its blocks nobody else references are cached (the most
    /// recently used, its first block most) or free.
    pub fn release(&mut self, slot: usize, tokens: &[u32], span: SpanId) {
        self.register(slot, tokens, span);
        let s = &mut self.slots[slot];
        s.owned = false;
        s.tokens.clear();
        for b in std::mem::take(&mut s.table).into_iter().rev() {
            let block = &mut self.blocks[b];
            block.refs -= 1;
            block.span = block.span.max(span);
            if block.refs > 0 {
                continue;
            }
            if block.tokens.is_empty() {
                self.forget(b);
                self.free.insert(b);
            } else {
                self.tick += 1;
                block.tick = self.tick;
                self.lru.insert((self.tick, b));
            }
        }
    }
}

/// What a lookup found.
#[derive(Debug, Default)]
struct Found {
    /// Full blocks of the prefix, in order.
    full: Vec<usize>,
    /// An unreferenced block after them, and how many of its tokens match.
    tail: Option<(usize, usize)>,
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

    /// A cache of `slots` slots of 16 positions in blocks of 4 (4 blocks a slot).
    fn cache(slots: usize) -> PrefixCache {
        PrefixCache::new(slots, 16, true).with_block(4)
    }

    fn table(t: &Taken) -> Vec<usize> {
        let blocks = &t.table.as_ref().unwrap().blocks;
        blocks.iter().map(|&b| b as usize).collect()
    }

    fn refs(c: &PrefixCache) -> Vec<usize> {
        c.blocks.iter().map(|b| b.refs).collect()
    }

    /// Every running sequence's blocks from the one it writes next (at the position given)
    /// on are its own.
    fn written_blocks_are_exclusive(c: &PrefixCache, running: &[(usize, usize)]) {
        for &(slot, at) in running {
            for &b in &c.slots[slot].table[at / c.block..] {
                assert_eq!(c.blocks[b].refs, 1, "block {b} of slot {slot} is shared");
            }
        }
    }

    #[test]
    fn a_model_with_ring_layers_reuses_no_prefix() {
        let gemma = ModelConfig::preset("tiny-gemma3").unwrap();
        assert!(gemma.layer_ring(0).is_some());
        assert!(!reuses_prefixes(&gemma));
        let mut c = PrefixCache::for_model(2, &gemma, true);
        assert!(!c.enabled());
        let prompt = ids(0..40);
        let t = c.take(&prompt).unwrap();
        c.register(t.slot, &prompt, span(1));
        c.release(t.slot, &prompt, span(2));
        let again = c.take(&prompt).unwrap();
        assert_eq!(again.reused, 0, "nothing reused: {again:?}");
        // Every layer paged (no ring): the cache is on.
        let llama = ModelConfig::preset("tiny-llama").unwrap();
        assert!(reuses_prefixes(&llama));
        assert!(PrefixCache::for_model(2, &llama, true).enabled());
        assert!(!PrefixCache::for_model(2, &llama, false).enabled());
    }

    #[test]
    fn a_shared_prefix_is_referenced_and_counted_not_copied() {
        let mut c = cache(3);
        let a = c.take(&ids(0..10)).unwrap();
        // The prompt's blocks; the others come as the sequence reaches them.
        assert_eq!((a.slot, a.reused, table(&a)), (0, 0, vec![0, 1, 2]));
        // Not registered before its prefill completed: nothing to reuse yet.
        let early = c.take(&ids(0..10)).unwrap();
        assert_eq!((early.reused, table(&early)), (0, vec![4, 5, 6]));
        c.release(early.slot, &[], span(2));
        c.register(a.slot, &ids(0..10), span(7));
        let b = c.take(&ids(0..9)).unwrap();
        // Blocks 0 and 1 (8 tokens) referenced; block 2 (tokens 8, 9) is a's, written on by
        // a's decode: b prefills token 8 in a block of its own.
        // It waits for the step that wrote them and the one that freed its fresh blocks.
        assert_eq!((b.slot, b.reused), (1, 8));
        assert_eq!(b.deps, vec![span(2), span(7)]);
        // Its fresh one is its slot region's own.
        assert_eq!(table(&b), vec![0, 1, 6]);
        assert_eq!(refs(&c)[..8], [2, 2, 1, 0, 0, 0, 1, 0]);
        written_blocks_are_exclusive(&c, &[(a.slot, 10), (b.slot, 8)]);
        // b reaching position 12 gets one more block, its region's next.
        let (grown, _) = c.grow(b.slot, 13).unwrap();
        assert_eq!(grown.blocks, vec![0, 1, 6, 7]);
        assert_eq!(c.grow(b.slot, 16), None);
        let s = c.stats();
        assert_eq!((s.hits, s.shared, s.reused_tokens), (1, 1, 8));
        assert_eq!(c.take(&ids(0..9)).map(|t| t.slot), Some(2));
        assert_eq!(c.take(&ids(0..9)), None, "no slot free");
    }

    #[test]
    fn everything_is_freed_or_cached_after_all_sequences_end() {
        let mut c = cache(3);
        let prompts = [ids(0..10), ids(0..13), ids(0..6)];
        let slots: Vec<usize> = prompts.iter().map(|p| c.take(p).unwrap().slot).collect();
        assert_eq!(slots, vec![0, 1, 2]);
        c.register(0, &prompts[0], span(1));
        c.release(1, &prompts[1], span(2));
        let again = c.take(&ids(0..15)).unwrap();
        // The ended sequence's three full blocks (a's first two hold the same tokens), and
        // one token of its last, adopted.
        assert_eq!((again.reused, table(&again)), (13, vec![4, 5, 6, 7]));
        written_blocks_are_exclusive(&c, &[(0, 10), (2, 0), (again.slot, 13)]);
        c.release(0, &ids(0..11), span(3));
        c.release(2, &prompts[2], span(4));
        c.release(again.slot, &ids(0..15), span(5));
        assert!(refs(&c).iter().all(|&r| r == 0), "{:?}", refs(&c));
        assert_eq!(c.blocks_in_use(), 0);
        assert_eq!(c.free.len() + c.blocks_cached(), 12);
        assert_eq!(c.free(), 3);
    }

    #[test]
    fn a_partly_matching_block_is_adopted_only_when_unreferenced() {
        let mut c = cache(3);
        c.take(&ids(0..10)).unwrap();
        assert!(c.grow(0, 13).is_some());
        c.release(0, &ids(0..13), span(2));
        // 11 of the 13 tokens match: two blocks referenced, the third adopted (3 tokens).
        let mut p = ids(0..11);
        p.push(500);
        let t = c.take(&p).unwrap();
        assert_eq!((t.reused, table(&t)[..3].to_vec()), (11, vec![0, 1, 2]));
        assert_eq!(t.deps, vec![span(2)]);
        // The adopted block is cut to its matching tokens: the old third block is gone.
        let u = c.take(&ids(0..13)).unwrap();
        assert_eq!(u.reused, 8);
        written_blocks_are_exclusive(&c, &[(t.slot, 11), (u.slot, 8)]);
        c.release(t.slot, &p, span(3));
        c.release(u.slot, &ids(0..13), span(4));
        // Never the whole prompt: the same prompt again prefills its last token.
        let t = c.take(&p).unwrap();
        assert_eq!(t.reused, 11);
        assert_eq!(c.stats().queries, 4);
    }

    #[test]
    fn eviction_takes_free_blocks_first_then_cached_ones_least_recently_used() {
        // Two slots, eight blocks.
        let mut c = cache(2);
        let a = c.take(&ids(0..9)).unwrap();
        c.release(a.slot, &ids(0..9), span(1));
        // a cached blocks 0, 1 and 2 (tail first in eviction order: 2, 1, 0); 3 is free.
        assert_eq!((c.blocks_cached(), c.free.len()), (3, 5));
        let b = c.take(&ids(100..115)).unwrap();
        let d = c.take(&ids(200..215)).unwrap();
        // b (slot 0) takes the free blocks, lowest first; d (slot 1) the last free one, then
        // evicts a's blocks one by one, its tail first.
        assert_eq!(table(&b), vec![3, 4, 5, 6]);
        assert_eq!(table(&d), vec![7, 2, 1, 0]);
        assert_eq!(c.stats().evictions, 3);
        // The evicted ones are gone: nothing of a is found.
        c.release(d.slot, &ids(200..215), span(3));
        c.release(b.slot, &ids(100..115), span(4));
        assert_eq!(c.take(&ids(0..9)).unwrap().reused, 0);
    }

    #[test]
    fn eviction_order_is_per_block_and_a_referenced_block_is_never_handed_out() {
        let mut c = cache(3);
        let old = c.take(&ids(0..13)).unwrap();
        c.release(old.slot, &ids(0..13), span(1));
        // Cached: old's blocks 0..4, evicted in the order 3, 2, 1, 0.
        let keep = c.take(&ids(0..9)).unwrap();
        assert_eq!((keep.reused, table(&keep)), (8, vec![0, 1, 4]));
        let one = c.take(&ids(100..115)).unwrap();
        let two = c.take(&ids(200..215)).unwrap();
        // The free blocks run out: block 3 is evicted, alone.
        assert_eq!(table(&one), vec![5, 6, 7, 8]);
        assert_eq!(table(&two), vec![9, 10, 11, 3]);
        assert_eq!(c.stats().evictions, 1);
        // keep reaching its last block evicts block 2, never 0 and 1 (referenced), though
        // they were freed after.
        assert_eq!(c.grow(keep.slot, 16).unwrap().0.blocks, vec![0, 1, 4, 2]);
        assert_eq!(c.stats().evictions, 2);
        let mut handed: Vec<usize> = c.slots.iter().flat_map(|s| s.table.clone()).collect();
        handed.sort();
        handed.dedup();
        assert_eq!(handed.len(), 12, "no block named by two running tables");
        written_blocks_are_exclusive(&c, &[(keep.slot, 8), (one.slot, 0), (two.slot, 0)]);
        assert_eq!(c.take(&ids(0..9)), None);
    }

    #[test]
    fn sequences_cancelled_at_any_point_leave_no_block_referenced() {
        // Four choices of one 13-token prompt: the first is cancelled after one chunk of 6
        // tokens, the next prefills it, two reference its blocks, one of which leaves before
        // its first chunk ran.
        let mut c = cache(4);
        let prompt = ids(0..13);
        let first = c.take(&prompt).unwrap();
        c.release(first.slot, &prompt[..6], span(1));
        let second = c.take(&prompt).unwrap();
        assert_eq!(second.reused, 6, "the cancelled chunk's block is adopted");
        c.register(second.slot, &prompt, span(2));
        let third = c.take(&prompt).unwrap();
        let fourth = c.take(&prompt).unwrap();
        assert_eq!((third.reused, fourth.reused), (12, 12));
        c.release(fourth.slot, &prompt[..12], span(3));
        assert_eq!(
            c.grow(third.slot, 16),
            None,
            "its prompt's 4 blocks hold 16"
        );
        c.release(third.slot, &ids(0..16), span(4));
        c.release(second.slot, &ids(0..14), span(5));
        assert_eq!((c.blocks_in_use(), c.free()), (0, 4));
        assert_eq!(c.free.len() + c.blocks_cached(), 16);
        // Served on: all four slots again.
        for _ in 0..4 {
            assert!(c.take(&ids(50..66)).is_some());
        }
    }

    #[test]
    fn salted_prompts_share_only_within_their_salt_and_skipping_reuses_nothing() {
        let mut c = cache(3);
        let salted = Lookup::new(true, Some("alice"));
        assert_ne!(salted.namespace, 0);
        c.take_with(&ids(0..12), salted).unwrap();
        c.release(0, &ids(0..12), span(1));
        // Neither the shared namespace nor another salt sees alice's blocks.
        let t = c.take(&ids(0..12)).unwrap();
        assert_eq!(t.reused, 0);
        c.release(t.slot, &ids(0..12), span(2));
        let bob = Lookup::new(true, Some("bob"));
        let t = c.take_with(&ids(0..12), bob).unwrap();
        assert_eq!(t.reused, 0);
        c.release(t.slot, &ids(100..112), span(3));
        // The same salt finds them.
        let t = c.take_with(&ids(0..12), salted).unwrap();
        assert_eq!(t.reused, 11);
        // Skipping looks nothing up, though the shared namespace holds the prompt.
        let t = c.take_with(&ids(0..12), Lookup::new(false, None)).unwrap();
        assert_eq!(t.reused, 0);
        assert_eq!(c.stats().queries, 4);
    }

    #[test]
    fn other_tokens_are_no_hit_and_off_sends_no_tables() {
        let mut c = cache(2);
        c.take(&ids(0..8)).unwrap();
        c.register(0, &ids(0..8), span(1));
        let mut p = ids(0..9);
        p[1] = 42;
        assert_eq!(c.take(&p).unwrap().reused, 0);
        let mut off = PrefixCache::new(1, 16, false);
        let t = off.take(&ids(0..8)).unwrap();
        assert_eq!((t.slot, t.table), (0, None));
        off.release(0, &ids(0..8), span(1));
        assert_eq!(off.take(&ids(0..8)).unwrap().reused, 0);
        assert_eq!(off.stats(), PrefixStats::default());
    }

    #[test]
    fn a_short_last_block_is_never_pooled() {
        // 18 positions in blocks of 4: four full blocks and a short one a slot.
        let mut c = PrefixCache::new(2, 18, true).with_block(4);
        let a = c.take(&ids(0..18)).unwrap();
        assert_eq!(
            table(&a),
            vec![0, 1, 2, 3],
            "logical block 4 stays slot 0's own"
        );
        c.release(a.slot, &ids(0..18), span(1));
        let b = c.take(&ids(0..18)).unwrap();
        assert_eq!(b.reused, 16);
        assert!(table(&b).iter().all(|&x| x % 5 < 4));
    }

    #[test]
    fn a_prompt_shares_its_blocks_only_past_one_block_and_with_a_lookup() {
        let c = cache(2);
        assert!(c.shares(5, Lookup::SHARED));
        assert!(c.shares(5, Lookup::new(true, Some("alice"))));
        // Its last token is prefilled: 4 tokens leave no whole block to lend.
        assert!(!c.shares(4, Lookup::SHARED));
        assert!(!c.shares(9, Lookup::new(false, None)));
        assert!(!PrefixCache::new(2, 64, false).shares(99, Lookup::SHARED));
    }
}
