//! The engine request every door starts from: the sampling fields a call set laid over the
//! server's defaults, and its generation length under the server's limit. A door fills in
//! the rest (prompt, stop strings, output options) from its own fields.

use std::collections::BTreeMap;

use kiln_engine::{EngineInfo, Request, SamplingParams};

use crate::config::ApiConfig;
use crate::error::ApiError;

/// The sampling fields a call set; what it leaves unset takes the server's default.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SamplingOverlay {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// 0: off.
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// Empty: the default's.
    pub logit_bias: BTreeMap<u32, f32>,
}

impl SamplingOverlay {
    /// The call's fields over `defaults`.
    pub fn over(&self, defaults: &SamplingParams) -> SamplingParams {
        let d = defaults;
        SamplingParams {
            temperature: self.temperature.unwrap_or(d.temperature),
            top_k: self.top_k.unwrap_or(d.top_k),
            top_p: self.top_p.unwrap_or(d.top_p),
            min_p: self.min_p.unwrap_or(d.min_p),
            repetition_penalty: self.repetition_penalty.unwrap_or(d.repetition_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(d.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(d.frequency_penalty),
            logit_bias: if self.logit_bias.is_empty() {
                d.logit_bias.clone()
            } else {
                self.logit_bias.clone()
            },
        }
    }
}

impl ApiConfig {
    /// A request (its prompt still empty) with the call's sampling over the server's
    /// defaults and its length under the server's limit: `max_tokens` as asked, or unset
    /// (the server's default, else `wire_default`, else up to the context).
    pub fn request(
        &self,
        info: &EngineInfo,
        sampling: &SamplingOverlay,
        max_tokens: Option<usize>,
        wire_default: Option<usize>,
    ) -> Result<Request, ApiError> {
        let max = self.max_tokens(info, max_tokens, wire_default)?;
        let mut r = Request::tokens(Vec::new());
        r.sampling = sampling.over(&self.default_sampling);
        r.stopping.max_new_tokens = max.asked;
        r.stopping.default_max_new_tokens = max.default;
        Ok(r)
    }
}

impl ApiConfig {
    /// A request whose length is a ceiling rather than a demand (Anthropic's `max_tokens`,
    /// which agents set high: Claude Code sends 32000): at most `ceiling` tokens and the
    /// server's limit, fewer where the context leaves less room, never refused for it.
    pub fn request_up_to(
        &self,
        info: &EngineInfo,
        sampling: &SamplingOverlay,
        ceiling: usize,
    ) -> Request {
        let mut r = Request::tokens(Vec::new());
        r.sampling = sampling.over(&self.default_sampling);
        r.stopping.default_max_new_tokens = Some(ceiling.min(self.max_tokens_limit(info)));
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unset_fields_take_the_server_defaults() {
        let defaults = SamplingParams {
            temperature: 0.6,
            top_k: 20,
            logit_bias: [(3, 1.0)].into(),
            ..SamplingParams::default()
        };
        let call = SamplingOverlay {
            top_p: Some(0.9),
            ..SamplingOverlay::default()
        };
        let s = call.over(&defaults);
        assert_eq!((s.temperature, s.top_k, s.top_p), (0.6, 20, 0.9));
        assert_eq!(s.logit_bias, defaults.logit_bias);
        let greedy = SamplingOverlay {
            temperature: Some(0.0),
            top_k: Some(0),
            ..SamplingOverlay::default()
        };
        assert_eq!(greedy.over(&defaults).temperature, 0.0);
        assert_eq!(greedy.over(&defaults).top_k, 0);
    }
}
