//! Stop strings matched across text deltas.

/// A stop string was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopHit {
    /// Index of the stop string in the list given to [`StopMatcher::new`].
    pub index: usize,
    /// The stop string itself.
    pub stop: String,
}

/// What one delta produced.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StopOutput {
    /// Text that is safe to emit now: it is not, and can no longer become, part of a stop
    /// string. When `hit` is set, this is all the text before the stop string.
    pub text: String,
    /// The stop string that ended generation, if one completed in this delta.
    pub hit: Option<StopHit>,
}

/// Finds stop strings in a stream of text deltas.
///
/// Text is held back only while it could still be the start of a stop string, so at most
/// `longest stop − 1` bytes are ever held. The first stop string to complete wins (the longest
/// one if several complete at the same byte); once a stop is found every later delta yields
/// nothing.
#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    stopped: bool,
}

impl StopMatcher {
    /// A matcher for `stops`; empty strings are ignored.
    pub fn new<I, S>(stops: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self {
            stops: stops.into_iter().map(Into::into).collect(),
            held: String::new(),
            stopped: false,
        }
    }

    /// Whether a stop string has been found.
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// Text currently held back.
    pub fn held(&self) -> &str {
        &self.held
    }

    /// Consumes one delta.
    pub fn push(&mut self, delta: &str) -> StopOutput {
        if self.stopped {
            return StopOutput::default();
        }
        self.held.push_str(delta);
        if let Some((start, index)) = self.first_match() {
            self.stopped = true;
            let mut text = std::mem::take(&mut self.held);
            text.truncate(start);
            let stop = self.stops.get(index).cloned().unwrap_or_default();
            return StopOutput {
                text,
                hit: Some(StopHit { index, stop }),
            };
        }
        let keep = self.longest_live_suffix();
        let text = self.held[..self.held.len() - keep].to_owned();
        self.held.drain(..self.held.len() - keep);
        StopOutput { text, hit: None }
    }

    /// Ends the stream: returns the held text (no stop can complete any more).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// `(start, stop index)` of the match ending first; the longest on a tie.
    fn first_match(&self) -> Option<(usize, usize)> {
        self.stops
            .iter()
            .enumerate()
            .filter(|(_, s)| !s.is_empty())
            .filter_map(|(i, s)| self.held.find(s.as_str()).map(|p| (p + s.len(), p, i)))
            .min()
            .map(|(_, start, index)| (start, index))
    }

    /// Length of the longest suffix of `held` that is a proper prefix of a stop string.
    fn longest_live_suffix(&self) -> usize {
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        let max = self.held.len().min(longest.saturating_sub(1));
        (1..=max)
            .rev()
            .find(|&k| {
                let at = self.held.len() - k;
                self.held.is_char_boundary(at) && {
                    let tail = &self.held[at..];
                    self.stops
                        .iter()
                        .any(|s| s.len() > k && s.starts_with(tail))
                }
            })
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_a_possible_prefix_and_releases_it() {
        let mut m = StopMatcher::new(["</s>"]);
        assert_eq!(m.push("hello <").text, "hello ");
        assert_eq!(m.held(), "<");
        assert_eq!(m.push("b>").text, "<b>");
        assert_eq!(m.push(" </").text, " ");
        let out = m.push("s> tail");
        assert_eq!(out.text, "");
        assert_eq!(
            out.hit,
            Some(StopHit {
                index: 0,
                stop: "</s>".into()
            })
        );
        assert!(m.is_stopped());
        assert_eq!(m.push("more"), StopOutput::default());
    }

    #[test]
    fn first_completed_stop_wins_longest_on_ties() {
        let mut m = StopMatcher::new(["abc", "b"]);
        let out = m.push("xab");
        assert_eq!(
            (out.text.as_str(), out.hit.map(|h| h.index)),
            ("xa", Some(1))
        );
        let mut m = StopMatcher::new(["b", "ab"]);
        let out = m.push("xab");
        assert_eq!(
            (out.text.as_str(), out.hit.map(|h| h.index)),
            ("x", Some(1))
        );
    }

    #[test]
    fn multibyte_prefixes_split_at_char_boundaries() {
        let mut m = StopMatcher::new(["🛑stop"]);
        assert_eq!(m.push("a🛑st").text, "a");
        assert_eq!(m.push("x").text, "🛑stx");
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn no_stops_passes_everything_through() {
        let mut m = StopMatcher::new(Vec::<String>::new());
        assert_eq!(m.push("abc").text, "abc");
        let mut m = StopMatcher::new([""]);
        assert_eq!(m.push("abc").text, "abc");
    }
}
