//! Capacity planning: how many KV bytes a token costs and how many blocks a budget buys.

use std::fmt;
use std::str::FromStr;

use crate::{BlockManagerConfig, KvError, Result};

/// Element type of the cached keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// 2 bytes per element.
    F16,
    /// 4 bytes per element.
    F32,
    /// 1 byte per element plus one `f32` scale per (token, KV head), for keys and for values.
    Int8,
    /// Half a byte per element (two to a byte) plus one `f16` scale and one `f16` zero point
    /// per (token, KV head): asymmetric, `value = q·scale + zero` with `q` in 0..=15.
    Int4,
}

impl KvDtype {
    /// Every KV dtype, in the order `kiln info` lists their capacities.
    pub const ALL: [KvDtype; 4] = [KvDtype::F32, KvDtype::F16, KvDtype::Int8, KvDtype::Int4];

    /// Bits of one element.
    pub fn element_bits(self) -> u64 {
        match self {
            KvDtype::F32 => 32,
            KvDtype::F16 => 16,
            KvDtype::Int8 => 8,
            KvDtype::Int4 => 4,
        }
    }

    /// Bytes stored beside each head vector of one token (the `Int8` scale; the `Int4` scale
    /// and zero point).
    pub fn scale_bytes_per_head(self) -> u64 {
        match self {
            KvDtype::Int8 | KvDtype::Int4 => 4,
            KvDtype::F16 | KvDtype::F32 => 0,
        }
    }

    /// Bytes of one head vector of `head_dim` elements, with what is stored beside it.
    pub fn head_bytes(self, head_dim: u32) -> u64 {
        (u64::from(head_dim) * self.element_bits()).div_ceil(8) + self.scale_bytes_per_head()
    }

    /// The name used on the command line (`f16`, `f32`, `int8`).
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F16 => "f16",
            KvDtype::F32 => "f32",
            KvDtype::Int8 => "int8",
            KvDtype::Int4 => "int4",
        }
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for KvDtype {
    type Err = KvError;

    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f16" | "fp16" => Ok(KvDtype::F16),
            "f32" | "fp32" => Ok(KvDtype::F32),
            "int8" | "i8" => Ok(KvDtype::Int8),
            "int4" | "i4" => Ok(KvDtype::Int4),
            _ => Err(KvError::InvalidConfig {
                field: "kv_dtype",
                reason: format!("unknown KV dtype `{s}`: expected one of f16, f32, int8, int4"),
            }),
        }
    }
}

/// The model dimensions that size the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    /// Transformer layers (each caches keys and values).
    pub num_layers: u32,
    /// Key/value heads (fewer than query heads under GQA/MQA).
    pub num_kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Storage type.
    pub dtype: KvDtype,
}

impl KvShape {
    /// `2 × layers × kv_heads × (head_dim × element bytes + scale bytes per head)`.
    pub fn bytes_per_token(&self) -> Result<u64> {
        let per_head = self.dtype.head_bytes(self.head_dim);
        2u64.checked_mul(u64::from(self.num_layers))
            .and_then(|v| v.checked_mul(u64::from(self.num_kv_heads)))
            .and_then(|v| v.checked_mul(per_head))
            .filter(|&v| v > 0)
            .ok_or_else(|| KvError::InvalidConfig {
                field: "kv shape",
                reason: format!("{self:?} gives no representable bytes per token"),
            })
    }
}

/// Where the KV memory figure comes from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KvBudget {
    /// An explicit number of bytes (`--kv-cache-memory`).
    Bytes(u64),
    /// A fraction of the device memory, less what is reserved for weights and activations.
    DeviceFraction {
        /// Device memory reported by the caller.
        device_bytes: u64,
        /// Fraction of it kiln may use, in `(0, 1]`.
        fraction: f64,
        /// Bytes of that share already spoken for (weights, activations, workspace).
        reserved_bytes: u64,
    },
}

impl KvBudget {
    /// The bytes available for KV blocks.
    pub fn bytes(&self) -> Result<u64> {
        match *self {
            KvBudget::Bytes(b) => Ok(b),
            KvBudget::DeviceFraction {
                device_bytes,
                fraction,
                reserved_bytes,
            } => {
                if !(fraction > 0.0 && fraction <= 1.0) {
                    return Err(KvError::InvalidConfig {
                        field: "memory fraction",
                        reason: format!("{fraction} is not in (0, 1]"),
                    });
                }
                let share = (device_bytes as f64 * fraction) as u64;
                Ok(share.saturating_sub(reserved_bytes))
            }
        }
    }
}

/// Inputs of [`KvPlan::new`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvPlanConfig {
    /// Model dimensions and KV dtype.
    pub shape: KvShape,
    /// Tokens per block.
    pub block_size: u32,
    /// The model's context length, for the "max-length sequences" figure.
    pub max_seq_len: usize,
    /// The memory to spend.
    pub budget: KvBudget,
}

/// How the KV cache fills a budget. `Display` (or [`explain`](Self::explain)) says it in words.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvPlan {
    /// Model dimensions and KV dtype.
    pub shape: KvShape,
    /// Tokens per block.
    pub block_size: u32,
    /// The model's context length.
    pub max_seq_len: usize,
    /// Bytes the budget allowed.
    pub budget_bytes: u64,
    /// KV bytes of one token over all layers (keys and values).
    pub bytes_per_token: u64,
    /// KV bytes of one block.
    pub bytes_per_block: u64,
    /// Blocks in the pool.
    pub num_blocks: u32,
    /// Whether `num_blocks` was capped so every slot index fits a `u32`.
    pub capped: bool,
}

impl KvPlan {
    /// Sizes the pool: as many whole blocks as the budget holds.
    pub fn new(cfg: &KvPlanConfig) -> Result<Self> {
        if cfg.block_size == 0 {
            return Err(KvError::InvalidConfig {
                field: "block_size",
                reason: "must be at least 1".into(),
            });
        }
        let bytes_per_token = cfg.shape.bytes_per_token()?;
        let bytes_per_block = bytes_per_token.saturating_mul(u64::from(cfg.block_size));
        let budget_bytes = cfg.budget.bytes()?;
        let fit = budget_bytes / bytes_per_block;
        if fit == 0 {
            return Err(KvError::BudgetTooSmall {
                budget_bytes,
                block_bytes: bytes_per_block,
            });
        }
        // Slots (block * B + offset) are u32 on the device; u32::MAX itself is the
        // trimmed-block placeholder.
        let limit = (u64::from(u32::MAX) / u64::from(cfg.block_size)).min(u64::from(u32::MAX - 1));
        let num_blocks = fit.min(limit) as u32;
        Ok(Self {
            shape: cfg.shape,
            block_size: cfg.block_size,
            max_seq_len: cfg.max_seq_len,
            budget_bytes,
            bytes_per_token,
            bytes_per_block,
            num_blocks,
            capped: fit > limit,
        })
    }

    /// Token slots in the pool.
    pub fn num_tokens(&self) -> u64 {
        u64::from(self.num_blocks) * u64::from(self.block_size)
    }

    /// Bytes the pool occupies (whole blocks only, so at most the budget).
    pub fn total_bytes(&self) -> u64 {
        u64::from(self.num_blocks) * self.bytes_per_block
    }

    /// Sequences of `max_seq_len` tokens that fit at once.
    pub fn max_len_sequences(&self) -> u64 {
        let per_seq = (self.max_seq_len as u64)
            .div_ceil(u64::from(self.block_size))
            .max(1);
        u64::from(self.num_blocks) / per_seq
    }

    /// A [`BlockManagerConfig`] for this pool, with the defaults for everything else.
    pub fn block_manager_config(&self) -> BlockManagerConfig {
        BlockManagerConfig {
            block_size: self.block_size,
            ..BlockManagerConfig::new(self.num_blocks)
        }
    }

    /// The plan in words (the same text as `Display`).
    pub fn explain(&self) -> String {
        self.to_string()
    }
}

/// Bytes in binary units, to two decimals.
pub(crate) fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.2} {}", UNITS[unit])
    }
}

impl fmt::Display for KvPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.shape;
        writeln!(
            f,
            "KV cache ({}): {} bytes per token = 2 x {} layers x {} KV heads x ({} x {} B{})",
            s.dtype,
            self.bytes_per_token,
            s.num_layers,
            s.num_kv_heads,
            s.head_dim,
            s.dtype.element_bits() as f64 / 8.0,
            match (s.dtype, s.dtype.scale_bytes_per_head()) {
                (_, 0) => String::new(),
                (KvDtype::Int4, n) => format!(" + {n} B scale and zero"),
                (_, n) => format!(" + {n} B scale"),
            }
        )?;
        writeln!(
            f,
            "  budget {} -> {} blocks of {} tokens ({} per block){}",
            human(self.budget_bytes),
            self.num_blocks,
            self.block_size,
            human(self.bytes_per_block),
            if self.capped {
                ", capped so slots fit u32"
            } else {
                ""
            }
        )?;
        write!(
            f,
            "  {} tokens in {}; {} sequences of the full {}-token context fit at once",
            self.num_tokens(),
            human(self.total_bytes()),
            self.max_len_sequences(),
            self.max_seq_len
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn smollm(dtype: KvDtype) -> KvShape {
        KvShape {
            num_layers: 30,
            num_kv_heads: 3,
            head_dim: 64,
            dtype,
        }
    }

    #[test]
    fn bytes_per_token_follows_the_formula() {
        assert_eq!(
            smollm(KvDtype::F16).bytes_per_token().unwrap(),
            2 * 30 * 3 * 64 * 2
        );
        assert_eq!(
            smollm(KvDtype::F32).bytes_per_token().unwrap(),
            2 * 30 * 3 * 64 * 4
        );
        assert_eq!(
            smollm(KvDtype::Int8).bytes_per_token().unwrap(),
            2 * 30 * 3 * (64 + 4)
        );
        assert_eq!(
            smollm(KvDtype::Int4).bytes_per_token().unwrap(),
            2 * 30 * 3 * (32 + 4)
        );
        let zero = KvShape {
            num_layers: 0,
            ..smollm(KvDtype::F16)
        };
        assert!(matches!(
            zero.bytes_per_token(),
            Err(KvError::InvalidConfig { .. })
        ));
    }

    #[test]
    fn plan_from_bytes_counts_whole_blocks() {
        let plan = KvPlan::new(&KvPlanConfig {
            shape: smollm(KvDtype::F16),
            block_size: 16,
            max_seq_len: 8192,
            budget: KvBudget::Bytes(1 << 30),
        })
        .unwrap();
        assert_eq!(plan.bytes_per_token, 23_040);
        assert_eq!(plan.bytes_per_block, 368_640);
        assert_eq!(plan.num_blocks, (1u64 << 30).div_euclid(368_640) as u32);
        assert_eq!(plan.num_tokens(), u64::from(plan.num_blocks) * 16);
        assert_eq!(plan.max_len_sequences(), u64::from(plan.num_blocks) / 512);
        assert!(plan.total_bytes() <= 1 << 30);
        let text = plan.explain();
        assert!(text.contains("23040 bytes per token"), "{text}");
        assert!(
            text.contains(&format!("{} blocks of 16 tokens", plan.num_blocks)),
            "{text}"
        );
        assert_eq!(plan.block_manager_config().num_blocks, plan.num_blocks);
    }

    #[test]
    fn plan_from_device_fraction_subtracts_reserved_bytes() {
        let cfg = KvPlanConfig {
            shape: smollm(KvDtype::Int8),
            block_size: 16,
            max_seq_len: 2048,
            budget: KvBudget::DeviceFraction {
                device_bytes: 8 << 30,
                fraction: 0.5,
                reserved_bytes: 1 << 30,
            },
        };
        let plan = KvPlan::new(&cfg).unwrap();
        assert_eq!(plan.budget_bytes, 3 << 30);
        assert_eq!(
            u64::from(plan.num_blocks),
            (3u64 << 30) / (16 * 2 * 30 * 3 * 68)
        );
        let bad = KvPlanConfig {
            budget: KvBudget::DeviceFraction {
                device_bytes: 8 << 30,
                fraction: 1.5,
                reserved_bytes: 0,
            },
            ..cfg
        };
        assert!(matches!(
            KvPlan::new(&bad),
            Err(KvError::InvalidConfig { .. })
        ));
    }

    #[test]
    fn tiny_budget_is_an_error_naming_the_block_size() {
        let err = KvPlan::new(&KvPlanConfig {
            shape: smollm(KvDtype::F32),
            block_size: 16,
            max_seq_len: 2048,
            budget: KvBudget::Bytes(1000),
        })
        .unwrap_err();
        assert_eq!(
            err,
            KvError::BudgetTooSmall {
                budget_bytes: 1000,
                block_bytes: 16 * 46_080
            }
        );
    }

    #[test]
    fn huge_budget_is_capped_so_slots_fit_u32() {
        let plan = KvPlan::new(&KvPlanConfig {
            shape: KvShape {
                num_layers: 1,
                num_kv_heads: 1,
                head_dim: 1,
                dtype: KvDtype::Int8,
            },
            block_size: 16,
            max_seq_len: 16,
            budget: KvBudget::Bytes(u64::MAX),
        })
        .unwrap();
        assert!(plan.capped);
        assert!(plan.num_tokens() <= u64::from(u32::MAX));
    }

    /// The promise: INT4 holds at least 3.5 times the tokens of F16 in the same
    /// memory at head_dim 64 (the default model), and more for larger heads.
    #[test]
    fn int4_holds_over_three_and_a_half_times_f16() {
        for head_dim in [64, 128, 256] {
            let plan = |dtype| {
                KvPlan::new(&KvPlanConfig {
                    shape: KvShape {
                        head_dim,
                        ..smollm(dtype)
                    },
                    block_size: 16,
                    max_seq_len: 2048,
                    budget: KvBudget::Bytes(1 << 30),
                })
                .unwrap()
                .num_tokens() as f64
            };
            let ratio = plan(KvDtype::Int4) / plan(KvDtype::F16);
            assert!(ratio >= 3.5, "head_dim {head_dim}: {ratio}");
        }
    }

    #[test]
    fn dtype_parses_its_names() {
        for d in KvDtype::ALL {
            assert_eq!(d.name().parse::<KvDtype>().unwrap(), d);
        }
        assert!("bf16".parse::<KvDtype>().is_err());
    }
}
