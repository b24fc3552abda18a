//! Prompt-lookup decoding: drafts copied from earlier in the sequence itself.

use super::{ProposeError, ProposeInput, Proposer};

/// Prompt-lookup decoding: no model, no state. For the largest `n` in `max_n` down to `min_n`
/// whose last-`n`-token pattern occurred earlier in the prompt or output, propose up to `k`
/// tokens that followed its most recent earlier occurrence. Strong on extractive work
/// (summaries, quoting, code edits), where the answer repeats the prompt.
#[derive(Debug, Clone, Copy)]
pub struct NgramProposer {
    pub min_n: usize,
    pub max_n: usize,
}

impl NgramProposer {
    /// The continuation for one token sequence.
    pub fn lookup(&self, tokens: &[u32], k: usize) -> Vec<u32> {
        let len = tokens.len();
        if k == 0 {
            return Vec::new();
        }
        for n in (self.min_n..=self.max_n.min(len.saturating_sub(1))).rev() {
            let pattern = &tokens[len - n..];
            // Most recent first: starts before `len - n`, so something follows the match.
            if let Some(start) = (0..len - n).rev().find(|&i| &tokens[i..i + n] == pattern) {
                let from = start + n;
                return tokens[from..(from + k).min(len)].to_vec();
            }
        }
        Vec::new()
    }
}

impl Proposer for NgramProposer {
    fn propose(&mut self, batch: &[ProposeInput<'_>]) -> Result<Vec<Vec<u32>>, ProposeError> {
        Ok(batch
            .iter()
            .map(|b| self.lookup(b.tokens, b.max_tokens))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ngram_lookup_takes_the_longest_pattern_and_its_latest_occurrence() {
        let p = NgramProposer { min_n: 1, max_n: 3 };
        // "1 2 3 9 ... 1 2 3 7 ... 1 2 3": the latest earlier "1 2 3" is followed by 7 8.
        let t = [1, 2, 3, 9, 5, 1, 2, 3, 7, 8, 1, 2, 3];
        assert_eq!(p.lookup(&t, 2), vec![7, 8]);
        assert_eq!(p.lookup(&t, 5), vec![7, 8, 1, 2, 3]);
        // A continuation cut short by the end of the tokens.
        assert_eq!(p.lookup(&[4, 5, 4], 3), vec![5, 4]);
        // No 3-gram or 2-gram match, a 1-gram one.
        assert_eq!(p.lookup(&[6, 1, 7, 8, 1], 2), vec![7, 8]);
        // min_n = 2 refuses the 1-gram match.
        let p2 = NgramProposer { min_n: 2, max_n: 3 };
        assert!(p2.lookup(&[6, 1, 7, 8, 1], 2).is_empty());
        // Nothing to find, or nothing asked.
        assert!(p.lookup(&[1, 2, 3], 4).is_empty());
        assert!(p.lookup(&[1], 4).is_empty());
        assert!(p.lookup(&t, 0).is_empty());
    }
}
