//! Chunked prefill under a step budget, shared by the benchmark scheduler and the server's
//! engine loop.
//!
//! A lane alternates: a decode step of every sequence it runs, then a step of prompt chunks
//! holding at most what the budget has left after those decode tokens (and at most
//! `max_prefill_tokens`). A prompt longer than that is prefilled over several chunk steps,
//! each at the position where its cached tokens end, so a running stream waits at most one
//! chunk step between two of its tokens. A step's rows all take the same number of tokens
//! (the kernels run `rows x seq`), so a chunk step gives every prompt it takes one length.

/// Most tokens one step may carry (`--max-step-tokens`).
pub const MAX_STEP_TOKENS: usize = 1 << 16;

/// The step budget when none is given.
pub const DEFAULT_STEP_TOKENS: usize = 512;

/// Which prompts a chunk step takes, and how many tokens each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ChunkPlan {
    /// Indices into the candidates, in their order.
    pub picked: Vec<usize>,
    /// Tokens each picked prompt gets (every row of a step has the same length).
    pub len: usize,
}

/// The prompt tokens a lane's chunk step may take: the step budget less the lane's decode
/// rows, within `max_prefill`.
pub(crate) fn chunk_budget(max_step: usize, max_prefill: usize, decoding: usize) -> usize {
    max_step.saturating_sub(decoding).min(max_prefill)
}

/// Picks a chunk step from `remaining` (each candidate prompt's uncached tokens, in priority
/// order: the first always gets a chunk) within `budget` tokens: the first prompt's chunk is
/// all it has left or the whole budget; later prompts join while each still has that many
/// tokens left and the rows fit the budget. `None` when the budget or the first is empty.
pub(crate) fn plan_chunk(remaining: &[usize], budget: usize) -> Option<ChunkPlan> {
    let first = *remaining.first()?;
    let len = first.min(budget);
    if len == 0 {
        return None;
    }
    let mut picked = vec![0];
    for (i, &left) in remaining.iter().enumerate().skip(1) {
        if (picked.len() + 1) * len > budget {
            break;
        }
        if left >= len {
            picked.push(i);
        }
    }
    Some(ChunkPlan { picked, len })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_prompt_is_cut_to_the_budget_and_equal_ones_share_a_step() {
        // 1500 tokens under 509 (512 less 3 decoding): two chunks of 509 and one of 482.
        let mut left = 1500;
        let mut chunks = Vec::new();
        while left > 0 {
            let p = plan_chunk(&[left], chunk_budget(512, 2048, 3)).unwrap();
            assert_eq!(p.picked, vec![0]);
            chunks.push(p.len);
            left -= p.len;
        }
        assert_eq!(chunks, vec![509, 509, 482]);
        // Prompts of 4 tokens batch while they fit; one of 2 cannot take 4.
        let p = plan_chunk(&[4, 4, 2, 9, 4, 4], 13).unwrap();
        assert_eq!(
            p,
            ChunkPlan {
                picked: vec![0, 1, 3],
                len: 4
            }
        );
        // The prefill cap binds under a larger step budget.
        assert_eq!(chunk_budget(512, 100, 8), 100);
        assert_eq!(chunk_budget(8, 100, 8), 0);
        assert_eq!(plan_chunk(&[5], 0), None);
        assert_eq!(plan_chunk(&[], 10), None);
    }
}
