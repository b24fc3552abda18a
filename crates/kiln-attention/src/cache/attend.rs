//! Paged attention over the cache ([`KvCache::attention`]): the GPU kernel (a workgroup per
//! query token, head and run of keys, with split-key runs weighed together by
//! `attention_combine.wgsl`), the rows kernel of CPU-type adapters and its unrolled per-key
//! code, and the host reference on the CPU backend.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock, PoisonError};

use bytemuck::{Pod, Zeroable};
use kiln_kv::KvDtype;
use kiln_tensor::{DType, Device, KernelDef, Recorder, Tensor};

use super::{
    AttnBatch, AttnConfig, HostPool, KvCache, R, SHARED_LANES, Store, W, dtype_define, flag,
    invalid, variant,
};
use crate::Result;
use crate::native::{CentredKeys, I4Rows, I8Rows};
use crate::reference;
use crate::stored::{CENTRED_PAIRS, hadamard_norm};

// `hadamard.wgsl` (the INT4 rotation) and `centre.wgsl` (its key centres) are prepended to
// the kernels that write or read K/V.
const ATTN_SRC: &str = concat!(
    include_str!("../../wgsl/hadamard.wgsl"),
    include_str!("../../wgsl/centre.wgsl"),
    include_str!("../../wgsl/paged_attention.wgsl")
);
static ATTN: KernelDef = KernelDef {
    name: "paged_attention",
    source: ATTN_SRC,
    bindings: &[R, R, R, W, R, R, R],
};
static ATTN_SCALED: KernelDef = KernelDef {
    name: "paged_attention",
    source: ATTN_SRC,
    bindings: &[R, R, R, W, R, R, R, R, R],
};
/// INT4: also the layer's key centres.
static ATTN_I4: KernelDef = KernelDef {
    name: "paged_attention",
    source: ATTN_SRC,
    bindings: &[R, R, R, W, R, R, R, R, R, R],
};
/// The second pass of split-key attention.
static ATTN_COMBINE: KernelDef = KernelDef {
    name: "attention_combine",
    source: include_str!("../../wgsl/attention_combine.wgsl"),
    bindings: &[R, W],
};
const ATTN_ROWS_SRC: &str = concat!(
    include_str!("../../wgsl/hadamard.wgsl"),
    include_str!("../../wgsl/centre.wgsl"),
    include_str!("../../wgsl/paged_attention_rows.wgsl")
);
static ATTN_ROWS: KernelDef = KernelDef {
    name: "paged_attention_rows",
    source: ATTN_ROWS_SRC,
    bindings: &[R, R, R, W, R, R, R],
};
static ATTN_ROWS_SCALED: KernelDef = KernelDef {
    name: "paged_attention_rows",
    source: ATTN_ROWS_SRC,
    bindings: &[R, R, R, W, R, R, R, R, R],
};
static ATTN_ROWS_I4: KernelDef = KernelDef {
    name: "paged_attention_rows",
    source: ATTN_ROWS_SRC,
    bindings: &[R, R, R, W, R, R, R, R, R, R],
};

/// The most keys one query may read in the one-invocation-per-head kernel of CPU-type
/// adapters: llvmpipe ends a loop nest after 65,535 iterations (the key loop, with the per-key
/// work unrolled), silently, so a longer context takes the workgroup kernel.
const ROWS_MAX_KEYS: usize = 65_000;

/// The rows kernel's per-key work, unrolled over the head (`K_DOT`: the score `s` of K row
/// `row` against `qv`; `V_ACC`: `acc` rescaled by `alpha` plus `pj` × V row `row`), for
/// `per_read` elements per 16-byte read (at most 32: INT4's eight vec4s). An INT4 score also
/// gets its key's centre terms back (`centre_term` of each of the [`CENTRED_PAIRS`]). Under
/// `broadcast` (the shared form with subgroups) lane c reads the row's words c, c + 8, ...
/// and each word reaches every lane by `subgroupBroadcast`.
fn rows_unrolled(head_dim: usize, per_read: usize, broadcast: bool) -> UnrolledCode {
    // Written out once per shape: a launch's recording costs a hash lookup and copies.
    type Memo = Mutex<HashMap<(usize, usize, bool), UnrolledCode>>;
    static MEMO: OnceLock<Memo> = OnceLock::new();
    let memo = MEMO.get_or_init(Default::default);
    let mut memo = memo.lock().unwrap_or_else(PoisonError::into_inner);
    memo.entry((head_dim, per_read, broadcast))
        .or_insert_with(|| write_unrolled(head_dim, per_read, broadcast))
        .clone()
}

/// The `K_DOT` and `V_ACC` defines [`rows_unrolled`] hands to the shader's preprocessor.
type UnrolledCode = [(&'static str, String); 2];

fn write_unrolled(head_dim: usize, per_read: usize, broadcast: bool) -> UnrolledCode {
    const PARTS: [&str; 8] = ["a", "b", "c", "d", "e", "f", "g", "h"];
    let vec4s = per_read / 4;
    let words = head_dim / per_read;
    let (mut k, mut v) = (String::new(), String::new());
    if broadcast {
        for r in 0..words.div_ceil(SHARED_LANES) {
            let at = |pool: &str| {
                format!(
                    "        let {pool}r{r} = {pool}_pool[row * NL + min(lane + {}u, NL - 1u)];\n",
                    r * SHARED_LANES
                )
            };
            k += &at("k");
            v += &at("v");
        }
    }
    for c in 0..words {
        let word = |pool: &str| {
            if broadcast {
                let (r, lane) = (c / SHARED_LANES, c % SHARED_LANES);
                format!("{pool}_dec(subgroupBroadcast({pool}r{r}, {lane}u), row)")
            } else {
                format!("{pool}_part(row, {c}u)")
            }
        };
        k += &format!("        {{\n            let k = {};\n", word("k"));
        v += &format!("        {{\n            let v = {};\n", word("v"));
        for (j, part) in PARTS.iter().enumerate().take(vec4s) {
            let i = c * vec4s + j;
            k += &format!("            s += dot(qv[{i}], k.{part});\n");
            v += &format!("            acc[{i}] = acc[{i}] * alpha + pj * v.{part};\n");
        }
        k += "        }\n";
        v += "        }\n";
    }
    if per_read == 32 {
        for i in 0..CENTRED_PAIRS {
            k += &format!("        s += centre_term(cq[{i}], j);\n");
        }
    }
    [("K_DOT", k), ("V_ACC", v)]
}

#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
struct AttnParams {
    tokens: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    block_size: u32,
    window: u32,
    scale: f32,
    had_norm: f32,
    groups: u32,
    /// The GPU kernel's split keys: runs per query, keys per run (1 and 0: unsplit).
    splits: u32,
    split_keys: u32,
    _pad: u32,
}

/// Split-key attention (flash-decoding) on the GPU kernel: a step whose (query token, head)
/// pairs are fewer than this many workgroups splits each query's keys into runs, one
/// workgroup each, so a decode step of a few sequences still spreads over the whole GPU.
const SPLIT_WORKGROUPS: usize = 1024;
/// Fewest keys of a run.
const SPLIT_MIN_KEYS: usize = 32;

/// `(runs, keys a run)` for `pairs` (query token, head) pairs whose queries read at most
/// `span` keys: (1, 0) where the pairs fill the GPU or the span is short.
fn key_split(pairs: usize, span: usize) -> (usize, usize) {
    let most = (SPLIT_WORKGROUPS / pairs.max(1)).max(1);
    let splits = span.div_ceil(SPLIT_MIN_KEYS).min(most);
    if splits <= 1 {
        return (1, 0);
    }
    let keys = span.div_ceil(splits);
    (span.div_ceil(keys), keys)
}

impl KvCache {
    /// Paged attention of q `[tokens, heads, head_dim]` over `layer`'s cache; returns the
    /// attention output in the same shape. The batch's K/V must have been written first.
    pub fn attention(
        &self,
        rec: &mut Recorder,
        layer: usize,
        q: &Tensor,
        batch: &AttnBatch,
        attn: &AttnConfig,
    ) -> Result<Tensor> {
        self.check_layer(layer)?;
        let (kvh, hd) = (self.cfg.kv_heads, self.cfg.head_dim);
        if attn.heads == 0 || !attn.heads.is_multiple_of(kvh) {
            return invalid(format!(
                "{} query heads are not a multiple of {kvh} kv heads",
                attn.heads
            ));
        }
        self.check_rows("Q", q, batch.tokens, attn.heads)?;
        self.check_sinks(attn)?;
        let window = attn.window.unwrap_or(0);
        match &self.store {
            Store::Cpu(layers) => {
                let qs = q.host_f32()?;
                let sinks = attn.sinks.as_ref().map(Tensor::host_f32).transpose()?;
                Tensor::from_f32_with(&self.device, q.shape(), |out| {
                    let call = HostCall {
                        q: qs,
                        sinks,
                        batch,
                        attn,
                    };
                    self.host_attention(&layers[layer], layer, &call, out)
                })
            }
            Store::Gpu(layers) => {
                let l = &layers[layer];
                let Some([info, tables, _]) = &batch.device else {
                    return invalid("batch was built for another device".into());
                };
                let out = rec.output(DType::F32, q.shape(), "paged_attention")?;
                let mut bufs = vec![q, info, tables, &out, &l.k, &l.v];
                bufs.extend(l.extras());
                let extras = bufs.len() - 6;
                // The sinks' binding comes last (binding 0 is the parameters); without sinks
                // the shader declares none and `q` fills the layout's slot unread.
                let sinks = [
                    ("SINKS", flag(attn.sinks.is_some())),
                    ("SINKS_AT", (bufs.len() + 1).to_string()),
                ];
                bufs.push(attn.sinks.as_ref().unwrap_or(q));
                let params = AttnParams {
                    tokens: batch.tokens as u32,
                    heads: attn.heads as u32,
                    kv_heads: kvh as u32,
                    head_dim: hd as u32,
                    block_size: self.cfg.block_size as u32,
                    window: window as u32,
                    scale: attn.scale,
                    had_norm: hadamard_norm(hd),
                    groups: batch.groups.len() as u32,
                    splits: 1,
                    split_keys: 0,
                    _pad: 0,
                };
                // CPU-type adapters take the one-invocation-per-head kernel, whose 16-byte
                // reads need the head size to be a whole number of them, while no query
                // reads more keys than its one loop may run (`ROWS_MAX_KEYS`).
                let per_read = match self.cfg.dtype {
                    KvDtype::F32 => 4,
                    KvDtype::F16 => 8,
                    KvDtype::Int8 => 16,
                    KvDtype::Int4 => 32,
                };
                let longest = batch
                    .positions()
                    .map(|pos| pos as usize + 1)
                    .max()
                    .unwrap_or(0)
                    .min(attn.window.unwrap_or(usize::MAX));
                // Its shared form, where a step's sequences bring two query tokens or more a
                // group on average, walks a group's keys once for up to 8 tokens (a query
                // reads at most SHARED_LANES - 1 keys more).
                let shared = 2 * batch.groups.len() <= batch.tokens;
                let reach = longest + if shared { SHARED_LANES } else { 0 };
                if self.cpu_adapter && hd.is_multiple_of(per_read) && reach <= ROWS_MAX_KEYS {
                    let sg = shared && self.shared_broadcast;
                    let work = if shared {
                        batch.groups.len() * attn.heads
                    } else {
                        (batch.tokens * attn.heads).div_ceil(8)
                    };
                    let [k_dot, v_acc] = rows_unrolled(hd, per_read, sg);
                    let (sg_arg, sg_lane) = if sg {
                        ("@builtin(subgroup_invocation_id) sg_lane: u32,", "sg_lane")
                    } else {
                        ("", "0u")
                    };
                    let defines = [
                        dtype_define(self.cfg.dtype),
                        ("HEAD_DIM", hd.to_string()),
                        ("SHARED", flag(shared)),
                        ("SG", flag(sg)),
                        ("SG_ARG", sg_arg.to_string()),
                        ("SG_LANE", sg_lane.to_string()),
                        k_dot,
                        v_acc,
                        sinks[0].clone(),
                        sinks[1].clone(),
                    ];
                    let groups = work as u32;
                    let def = variant([&ATTN_ROWS, &ATTN_ROWS_SCALED, &ATTN_ROWS_I4], extras);
                    rec.launch(def, &defines, &params, &bufs, groups)?;
                    return Ok(out);
                }
                let pairs = batch.tokens * attn.heads;
                let [sinks, sinks_at] = sinks;
                let defines = [
                    dtype_define(self.cfg.dtype),
                    ("HEAD_DIM", hd.to_string()),
                    sinks,
                    sinks_at,
                ];
                let def = variant([&ATTN, &ATTN_SCALED, &ATTN_I4], extras);
                let (splits, split_keys) = key_split(pairs, longest);
                if splits == 1 {
                    rec.launch(def, &defines, &params, &bufs, pairs as u32)?;
                    return Ok(out);
                }
                // Each run's output and (max, sum), then the runs weighed together.
                let parts = rec.output(
                    DType::F32,
                    &[pairs * splits * (hd + 2)],
                    "paged_attention_parts",
                )?;
                bufs[3] = &parts;
                let params = AttnParams {
                    splits: splits as u32,
                    split_keys: split_keys as u32,
                    ..params
                };
                rec.launch(def, &defines, &params, &bufs, (pairs * splits) as u32)?;
                rec.launch(&ATTN_COMBINE, &[], &params, &[&parts, &out], pairs as u32)?;
                Ok(out)
            }
        }
    }

    /// [`KvCache::attention`] over a host cache's pools of `layer` into `out`: the native
    /// kernels, or the reference's.
    fn host_attention(
        &self,
        pools: &[HostPool; 2],
        layer: usize,
        host: &HostCall<'_>,
        out: &mut [f32],
    ) -> Result<()> {
        let (cfg, kvh, hd) = (&self.cfg, self.cfg.kv_heads, self.cfg.head_dim);
        let &HostCall {
            q: qs,
            sinks,
            batch,
            attn,
        } = host;
        match (&self.device, pools) {
            (Device::Cpu(cpu), pools) => {
                let call = crate::native::Attend {
                    cpu,
                    q: qs,
                    sinks,
                    batch,
                    cfg,
                    attn,
                    lists: &self.call,
                };
                let d = hd;
                match pools {
                    [HostPool::F16(k), HostPool::F16(v)] => call.attention(&k[..], &v[..], out),
                    [HostPool::F32(k), HostPool::F32(v)] => call.attention(&k[..], &v[..], out),
                    [
                        HostPool::I8 { q: k, scale: ks },
                        HostPool::I8 { q: v, scale: vs },
                    ] => call.attention(
                        &I8Rows {
                            q: k,
                            params: ks,
                            d,
                        },
                        &I8Rows {
                            q: v,
                            params: vs,
                            d,
                        },
                        out,
                    ),
                    [
                        HostPool::I4 { q: k, params: kp },
                        HostPool::I4 { q: v, params: vp },
                    ] => {
                        let last = batch.positions().max();
                        if let Some(p) = last.filter(|&p| !self.turns.covers(p as usize)) {
                            return invalid(format!(
                                "attention at position {p}: no key was written there"
                            ));
                        }
                        let first = layer * kvh * CENTRED_PAIRS;
                        let keys = CentredKeys {
                            rows: I4Rows {
                                q: k,
                                params: kp,
                                d,
                            },
                            centres: &self.centres[first..][..kvh * CENTRED_PAIRS],
                            first,
                            turns: &self.turns,
                        };
                        call.attention(
                            &keys,
                            &I4Rows {
                                q: v,
                                params: vp,
                                d,
                            },
                            out,
                        )
                    }
                    _ => {
                        return invalid("the host pools do not match the device".into());
                    }
                }
            }
            (_, [HostPool::F32(k), HostPool::F32(v)]) => out.copy_from_slice(
                &reference::paged_attention_host(qs, k, v, batch, cfg, attn, sinks),
            ),
            _ => return invalid("the host pools do not match the device".into()),
        }
        Ok(())
    }
}

/// A host attention call's inputs as host slices: the queries and the sinks, if any.
struct HostCall<'a> {
    q: &'a [f32],
    sinks: Option<&'a [f32]>,
    batch: &'a AttnBatch,
    attn: &'a AttnConfig,
}

#[cfg(test)]
mod tests {
    use super::key_split;

    #[test]
    fn key_split_fills_the_gpu_only_where_the_pairs_do_not() {
        // Decode of one 7B-shaped sequence: 32 heads, 145 keys, runs of at least 32.
        assert_eq!(key_split(32, 145), (5, 29));
        // The test's 4 queries of 8 heads over 301 keys.
        assert_eq!(key_split(32, 301), (10, 31));
        // Long contexts: at most SPLIT_WORKGROUPS / pairs runs, every key in one.
        let (runs, keys) = key_split(32, 100_000);
        assert_eq!(runs, 32);
        assert!(runs * keys >= 100_000 && (runs - 1) * keys < 100_000);
        // Short spans and full steps stay whole.
        assert_eq!(key_split(32, 32), (1, 0));
        assert_eq!(key_split(2048, 4096), (1, 0));
        assert_eq!(key_split(600, 4096), (1, 0));
        assert_eq!(key_split(512, 4096), (2, 2048));
    }
}
