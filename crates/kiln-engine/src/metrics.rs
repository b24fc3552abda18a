//! What LLM operators diagnose with: TTFT (prefill), ITL (decode), queue and end-to-end
//! latency, queue depths, KV usage, prefix-cache hits and token counts, as Prometheus metrics.

use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// The finish label of `kiln_requests_finished_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FinishLabel {
    /// A [`FinishReason::name`](crate::FinishReason::name), or `error`, `cancelled`,
    /// `abandoned` (the caller went away), `deadline`.
    pub reason: String,
}

/// The labels of `vllm:cache_config_info`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CacheConfigLabels {
    block_size: String,
    num_gpu_blocks: String,
}

/// The engine's metrics; the handle shares them, the step loop records them.
#[derive(Debug)]
pub struct EngineMetrics {
    registry: Registry,
    pub(crate) ttft: Histogram,
    pub(crate) itl: Histogram,
    pub(crate) queue_time: Histogram,
    pub(crate) e2e: Histogram,
    pub(crate) step_tokens: Histogram,
    pub(crate) running: Gauge,
    pub(crate) waiting: Gauge,
    pub(crate) preempted: Gauge,
    /// Waiting for admission, preempted ones included (vLLM's `num_requests_waiting`).
    pub(crate) queued: Gauge,
    pub(crate) kv_usage: Gauge<f64, AtomicU64>,
    pub(crate) kv_used_blocks: Gauge,
    pub(crate) kv_total_blocks: Gauge,
    pub(crate) prefix_hit_tokens: Counter,
    pub(crate) prefix_query_tokens: Counter,
    pub(crate) prompt_tokens: Counter,
    pub(crate) generation_tokens: Counter,
    pub(crate) preemptions: Counter,
    pub(crate) finished: Family<FinishLabel, Counter>,
    pub(crate) spec_proposed: Counter,
    pub(crate) spec_accepted: Counter,
    pub(crate) spec_steps: Counter,
    pub(crate) spec_acceptance: Gauge<f64, AtomicU64>,
    pub(crate) spec_mean_accepted: Gauge<f64, AtomicU64>,
    /// Structured output: computing one allowed-token mask, and what sampling waited for it.
    pub(crate) mask_compute: Histogram,
    pub(crate) mask_wait: Histogram,
    /// When the step loop last turned holding work (health reads it to see a stuck engine).
    pub(crate) step_clock: StepClock,
}

/// When the step loop last turned while holding work, as microseconds since the engine
/// started (0: it waits idle).
#[derive(Debug)]
pub(crate) struct StepClock {
    epoch: Instant,
    turned_us: AtomicU64,
}

impl StepClock {
    fn new() -> Self {
        Self {
            epoch: Instant::now(),
            turned_us: AtomicU64::new(0),
        }
    }

    /// The loop goes round (it holds work, or is about to look for some).
    pub(crate) fn turn(&self) {
        let us = (self.epoch.elapsed().as_micros() as u64).max(1);
        self.turned_us.store(us, Ordering::Release);
    }

    /// The loop waits for a command with nothing in flight: no progress is owed.
    pub(crate) fn idle(&self) {
        self.turned_us.store(0, Ordering::Release);
    }

    /// How long since the loop last went round while holding work; `None` while it waits
    /// idle. A hung step, or a loop that stopped turning, shows here.
    pub(crate) fn stalled_for(&self) -> Option<Duration> {
        match self.turned_us.load(Ordering::Acquire) {
            0 => None,
            us => Some(
                self.epoch
                    .elapsed()
                    .saturating_sub(Duration::from_micros(us)),
            ),
        }
    }
}

impl EngineMetrics {
    pub(crate) fn new() -> Self {
        let mut registry = Registry::with_prefix("kiln");
        // 1 ms .. ~65 s for request latencies, 0.5 ms .. ~16 s for a token gap.
        let latency = || Histogram::new(exponential_buckets(0.001, 2.0, 17));
        let gap = || Histogram::new(exponential_buckets(0.0005, 2.0, 16));
        let m = Self {
            ttft: latency(),
            itl: gap(),
            queue_time: latency(),
            e2e: latency(),
            step_tokens: Histogram::new(exponential_buckets(1.0, 2.0, 14)),
            running: Gauge::default(),
            waiting: Gauge::default(),
            preempted: Gauge::default(),
            queued: Gauge::default(),
            kv_usage: Gauge::default(),
            kv_used_blocks: Gauge::default(),
            kv_total_blocks: Gauge::default(),
            prefix_hit_tokens: Counter::default(),
            prefix_query_tokens: Counter::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            preemptions: Counter::default(),
            finished: Family::default(),
            spec_proposed: Counter::default(),
            spec_accepted: Counter::default(),
            spec_steps: Counter::default(),
            spec_acceptance: Gauge::default(),
            spec_mean_accepted: Gauge::default(),
            mask_compute: Histogram::new(exponential_buckets(0.000_01, 2.0, 18)),
            mask_wait: Histogram::new(exponential_buckets(0.000_01, 2.0, 18)),
            step_clock: StepClock::new(),
            registry: Registry::default(),
        };
        let r = &mut registry;
        r.register(
            "time_to_first_token_seconds",
            "Submission to first token (prefill)",
            m.ttft.clone(),
        );
        r.register(
            "inter_token_latency_seconds",
            "Gap between consecutive tokens of a sequence (decode)",
            m.itl.clone(),
        );
        r.register(
            "queue_time_seconds",
            "Submission to first admission",
            m.queue_time.clone(),
        );
        r.register(
            "e2e_request_latency_seconds",
            "Submission to the last event",
            m.e2e.clone(),
        );
        r.register(
            "step_tokens",
            "Tokens computed per engine step",
            m.step_tokens.clone(),
        );
        r.register(
            "requests_running",
            "Sequences holding KV blocks",
            m.running.clone(),
        );
        r.register(
            "requests_waiting",
            "Sequences waiting for admission",
            m.waiting.clone(),
        );
        r.register(
            "requests_preempted",
            "Sequences preempted and waiting to recompute",
            m.preempted.clone(),
        );
        r.register(
            "kv_cache_usage_ratio",
            "Fraction of KV blocks referenced by sequences",
            m.kv_usage.clone(),
        );
        r.register(
            "kv_cache_used_blocks",
            "KV blocks referenced by sequences",
            m.kv_used_blocks.clone(),
        );
        r.register(
            "kv_cache_total_blocks",
            "KV blocks in the pool",
            m.kv_total_blocks.clone(),
        );
        r.register(
            "prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache",
            m.prefix_hit_tokens.clone(),
        );
        r.register(
            "prefix_cache_query_tokens",
            "Prompt tokens looked up in the prefix cache",
            m.prefix_query_tokens.clone(),
        );
        r.register(
            "prompt_tokens",
            "Prompt tokens of admitted requests",
            m.prompt_tokens.clone(),
        );
        r.register(
            "generation_tokens",
            "Tokens generated",
            m.generation_tokens.clone(),
        );
        r.register(
            "preemptions",
            "Sequences preempted for KV memory",
            m.preemptions.clone(),
        );
        r.register(
            "requests_finished",
            "Requests ended, by reason",
            m.finished.clone(),
        );
        r.register(
            "spec_decode_proposed_tokens",
            "Draft tokens proposed for verification (speculative decoding)",
            m.spec_proposed.clone(),
        );
        r.register(
            "spec_decode_accepted_tokens",
            "Draft tokens the target model accepted",
            m.spec_accepted.clone(),
        );
        r.register(
            "spec_decode_verify_steps",
            "Sequence steps that verified a draft",
            m.spec_steps.clone(),
        );
        r.register(
            "spec_decode_acceptance_ratio",
            "Accepted over proposed draft tokens, since start",
            m.spec_acceptance.clone(),
        );
        r.register(
            "spec_decode_mean_accepted_length",
            "Draft tokens accepted per verifying step, since start (tokens per step: this + 1)",
            m.spec_mean_accepted.clone(),
        );
        r.register(
            "structured_output_mask_seconds",
            "Computing one constrained output's allowed-token mask (on a worker thread)",
            m.mask_compute.clone(),
        );
        r.register(
            "structured_output_mask_wait_seconds",
            "What sampling a constrained output waited for its mask after the forward pass",
            m.mask_wait.clone(),
        );
        Self { registry, ..m }
    }

    /// The same figures under the names vLLM exports (`vllm:num_requests_running`, ...), for
    /// routers, autoscalers and dashboards built for vLLM: the metric objects are shared, so
    /// both names always read alike. Every sample carries `model_name` and `engine="0"` as
    /// vLLM's do; `vllm:cache_config_info` is 1 with the pool's `block_size` and
    /// `num_gpu_blocks`.
    pub fn vllm_registry(&self, model_name: &str, block_size: usize) -> Registry {
        let labels = [
            (
                Cow::Borrowed("model_name"),
                Cow::Owned(model_name.to_owned()),
            ),
            (Cow::Borrowed("engine"), Cow::Borrowed("0")),
        ];
        let mut r = Registry::with_labels(labels.into_iter());
        let gauges: [(&str, &str, &Gauge); 2] = [
            (
                "vllm:num_requests_running",
                "Sequences in the running batch (holding KV blocks)",
                &self.running,
            ),
            (
                "vllm:num_requests_waiting",
                "Sequences waiting for admission, preempted ones included",
                &self.queued,
            ),
        ];
        for (name, help, g) in gauges {
            r.register(name, help, g.clone());
        }
        // Evictable prefix-cache blocks count as free: a router must not see a full server
        // that is only keeping old prefixes around.
        r.register(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage, 1 = 100% (evictable prefix-cache blocks count as free)",
            self.kv_usage.clone(),
        );
        r.register(
            "vllm:gpu_cache_usage_perc",
            "KV-cache usage, 1 = 100% (the older name of vllm:kv_cache_usage_perc)",
            self.kv_usage.clone(),
        );
        let info = Family::<CacheConfigLabels, Gauge>::default();
        info.get_or_create(&CacheConfigLabels {
            block_size: block_size.to_string(),
            num_gpu_blocks: self.kv_total_blocks.get().to_string(),
        })
        .set(1);
        r.register(
            "vllm:cache_config_info",
            "Information of the KV cache config",
            info,
        );
        let counters: [(&str, &str, &Counter); 8] = [
            (
                "vllm:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache",
                &self.prefix_query_tokens,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prompt tokens served from the prefix cache",
                &self.prefix_hit_tokens,
            ),
            (
                "vllm:prompt_tokens",
                "Prompt tokens of admitted requests",
                &self.prompt_tokens,
            ),
            (
                "vllm:generation_tokens",
                "Tokens generated",
                &self.generation_tokens,
            ),
            (
                "vllm:num_preemptions",
                "Sequences preempted for KV memory",
                &self.preemptions,
            ),
            (
                "vllm:spec_decode_num_drafts",
                "Sequence steps that verified a draft",
                &self.spec_steps,
            ),
            (
                "vllm:spec_decode_num_draft_tokens",
                "Draft tokens proposed for verification",
                &self.spec_proposed,
            ),
            (
                "vllm:spec_decode_num_accepted_tokens",
                "Draft tokens the target model accepted",
                &self.spec_accepted,
            ),
        ];
        for (name, help, c) in counters {
            r.register(name, help, c.clone());
        }
        let histograms: [(&str, &str, &Histogram); 4] = [
            (
                "vllm:time_to_first_token_seconds",
                "Submission to first token, seconds",
                &self.ttft,
            ),
            (
                "vllm:inter_token_latency_seconds",
                "Gap between consecutive tokens of a sequence, seconds",
                &self.itl,
            ),
            (
                "vllm:e2e_request_latency_seconds",
                "Submission to the last event, seconds",
                &self.e2e,
            ),
            (
                "vllm:request_queue_time_seconds",
                "Submission to first admission, seconds",
                &self.queue_time,
            ),
        ];
        for (name, help, h) in histograms {
            r.register(name, help, h.clone());
        }
        r
    }

    /// Counts one sequence's verification of `proposed` draft tokens of which `accepted` held.
    pub(crate) fn verified(&self, proposed: usize, accepted: usize) {
        self.spec_proposed.inc_by(proposed as u64);
        self.spec_accepted.inc_by(accepted as u64);
        self.spec_steps.inc();
        let stats = crate::SpecStats {
            proposed_tokens: self.spec_proposed.get(),
            accepted_tokens: self.spec_accepted.get(),
            verify_steps: self.spec_steps.get(),
        };
        self.spec_acceptance.set(stats.acceptance_rate());
        self.spec_mean_accepted.set(stats.mean_accepted_length());
    }

    /// Counts a request that ended for `reason`.
    pub(crate) fn finished(&self, reason: &str) {
        self.finished
            .get_or_create(&FinishLabel {
                reason: reason.to_owned(),
            })
            .inc();
    }

    /// The metrics in the Prometheus / OpenMetrics text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        self.encode_metrics(&mut out);
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode_eof(&mut out);
        out
    }

    /// The metrics without the closing `# EOF` line, for an exposition that appends metrics of
    /// its own (a server's) before ending it with
    /// [`encode_eof`](prometheus_client::encoding::text::encode_eof).
    pub fn encode_metrics(&self, out: &mut String) {
        let _ = prometheus_client::encoding::text::encode_registry(out, &self.registry);
    }
}
