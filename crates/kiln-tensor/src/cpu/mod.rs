//! The native CPU backend: what `--backend cpu` runs on a machine without a GPU.
//!
//! Tensors live in host memory exactly as on the reference backend (the two share
//! [`Storage::Cpu`](crate::tensor::Storage)); what differs is how ops run. A matmul quantizes
//! each row of X to 8 bits per 32-element block ([`QuantX`]), then takes integer dot products
//! against the weight's own blocks, decoded in registers (each format's row of the format
//! table says how), on a thread pool split by output rows. Ops without a native kernel run
//! their reference.
//!
//! Numerics are defined once, by the portable kernel (`dot::rows_portable`): per 32-element
//! group (per 16-element half where a format's scales change every 16), the exact integer
//! dot product of W's quants with X's, scaled by `a·dx` and added to an f32 accumulator (one
//! a half); a format's offsets `b·dx·Σx` go to another; the accumulators are summed in a
//! fixed order. Every SIMD level computes exactly that, so results are bit-identical across
//! ISAs and batch sizes.

mod act;
mod activation;
mod dispatch;
mod dot;
mod linear;
mod vector;
#[cfg(target_arch = "x86_64")]
mod x86;

pub(crate) use act::QuantX;
pub(crate) use linear::{Fused, LinearScratch, linear_native, linear_routed_native};

use std::fmt;
use std::str::FromStr;

use std::sync::atomic::{AtomicBool, Ordering};

use crate::Keep;
use crate::device::DeviceOptions;
use crate::{Result, TensorError};

/// The instruction sets the native CPU backend has kernels for, lowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Plain Rust: the definition every other level matches bit for bit.
    Scalar,
    /// AVX2 (`vpmaddubsw`, `vpmaddwd`) with FMA and F16C, x86-64 from Haswell on.
    Avx2,
    /// AVX-512 VNNI on 256-bit registers (`vpdpbusd`): one instruction a four-element dot.
    Avx512,
}

impl Isa {
    /// The name `KILN_CPU_ISA` and `kiln info` use.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// The best level this CPU runs.
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            let avx2 = has!("avx2") && has!("fma") && has!("f16c");
            if avx2 && has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512vnni")
            {
                return Isa::Avx512;
            }
            if avx2 {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    }

    /// Every level this CPU runs, lowest first (tests run each).
    pub fn available() -> Vec<Isa> {
        let best = Isa::detect();
        [Isa::Scalar, Isa::Avx2, Isa::Avx512]
            .into_iter()
            .filter(|&i| i <= best)
            .collect()
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// `scalar`, `avx2` or `avx512`, any case.
impl FromStr for Isa {
    type Err = TensorError;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "scalar" => Ok(Isa::Scalar),
            "avx2" => Ok(Isa::Avx2),
            "avx512" => Ok(Isa::Avx512),
            other => Err(TensorError::Invalid {
                op: "KILN_CPU_ISA",
                detail: format!("`{other}`: expected scalar, avx2 or avx512"),
            }),
        }
    }
}

/// The native CPU backend's state: its instruction set and its thread pool.
pub struct CpuContext {
    isa: Isa,
    pool: rayon::ThreadPool,
    /// The matmul's buffers (X quantized, X normed, the products), kept between calls.
    linear: Keep<LinearScratch>,
    /// What the routed products read of their experts ([`RoutedStats`]).
    pub(crate) routed: RoutedCounters,
}

/// What the routed products ([`crate::Recorder::linear_routed`]) of a native CPU device read
/// of their expert stacks since the last reset: calls, experts and weight bytes read (an
/// expert is read once a call when any slot routes to it) against what the stacks hold.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RoutedStats {
    pub calls: u64,
    pub experts_read: u64,
    pub experts_held: u64,
    pub bytes_read: u64,
    pub bytes_held: u64,
}

impl RoutedStats {
    /// The share of the expert bytes held that were read (0 before any call).
    pub fn bytes_share(&self) -> f64 {
        self.bytes_read as f64 / self.bytes_held.max(1) as f64
    }
}

/// [`RoutedStats`] as counters the pool's callers add to.
#[derive(Debug, Default)]
pub(crate) struct RoutedCounters([std::sync::atomic::AtomicU64; 5]);

impl RoutedCounters {
    /// One call that read `read` of `held` experts of `expert_bytes` each.
    pub(crate) fn add(&self, read: u64, held: u64, expert_bytes: u64) {
        use std::sync::atomic::Ordering::Relaxed;
        for (c, v) in self
            .0
            .iter()
            .zip([1, read, held, read * expert_bytes, held * expert_bytes])
        {
            c.fetch_add(v, Relaxed);
        }
    }

    pub(crate) fn take(&self) -> RoutedStats {
        use std::sync::atomic::Ordering::Relaxed;
        let [calls, experts_read, experts_held, bytes_read, bytes_held] =
            std::array::from_fn(|i| self.0[i].swap(0, Relaxed));
        RoutedStats {
            calls,
            experts_read,
            experts_held,
            bytes_read,
            bytes_held,
        }
    }
}

impl fmt::Debug for CpuContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CpuContext")
            .field("isa", &self.isa)
            .field("threads", &self.threads())
            .finish()
    }
}

impl CpuContext {
    /// A pool of `opts.threads` (default: one a core) at the best ISA the CPU has, capped by
    /// `opts.cpu_isa` or env `KILN_CPU_ISA`.
    pub(crate) fn new(opts: &DeviceOptions) -> Result<Self> {
        let cap = match opts.cpu_isa {
            Some(i) => Some(i),
            None => match std::env::var("KILN_CPU_ISA") {
                Ok(v) if !v.trim().is_empty() => Some(v.parse()?),
                _ => None,
            },
        };
        let best = Isa::detect();
        let isa = cap.map_or(best, |c| c.min(best));
        let threads = match opts.threads {
            Some(0) => {
                return Err(TensorError::Invalid {
                    op: "--threads",
                    detail: "0 threads: expected at least 1".into(),
                });
            }
            Some(n) => n,
            None => std::thread::available_parallelism().map_or(1, |n| n.get()),
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("kiln-cpu-{i}"))
            .build()
            .map_err(|e| TensorError::Invalid {
                op: "cpu backend",
                detail: format!("cannot start {threads} threads: {e}"),
            })?;
        Ok(Self {
            isa,
            pool,
            linear: Keep::default(),
            routed: RoutedCounters::default(),
        })
    }

    pub fn isa(&self) -> Isa {
        self.isa
    }

    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    pub(crate) fn pool(&self) -> &rayon::ThreadPool {
        &self.pool
    }

    /// `a · b` in the numerics `vector` defines (bit-identical at every ISA).
    pub fn dot(&self, a: &[f32], b: &[f32]) -> f32 {
        dispatch::dot_f32(self.isa, a, b)
    }

    /// `a · b` for an f16 `b`, as [`CpuContext::dot`] of it widened.
    pub fn dot_f16(&self, a: &[f32], b: &[half::f16]) -> f32 {
        dispatch::dot_f16(self.isa, a, b)
    }

    /// `y += w·x`, a product then a sum an element.
    pub fn axpy(&self, w: f32, x: &[f32], y: &mut [f32]) {
        dispatch::axpy_f32(self.isa, w, x, y)
    }

    /// `y += w·x` for an f16 `x`.
    pub fn axpy_f16(&self, w: f32, x: &[half::f16], y: &mut [f32]) {
        dispatch::axpy_f16(self.isa, w, x, y)
    }

    /// [`CpuContext::dot`] of `a` with each row of `pool` that starts at one of `starts` (each
    /// as long as `a`), into `out`; the same results as one call a row, `a` read once for
    /// many rows.
    ///
    /// # Panics
    /// When a row runs past the pool or `out` is shorter than `starts`.
    pub fn dots(&self, a: &[f32], pool: &[f32], starts: &[usize], out: &mut [f32]) {
        dispatch::dots_f32(self.isa, a, pool, starts, out)
    }

    /// [`CpuContext::dots`] over an f16 pool.
    ///
    /// # Panics
    /// As [`CpuContext::dots`].
    pub fn dots_f16(&self, a: &[f32], pool: &[half::f16], starts: &[usize], out: &mut [f32]) {
        dispatch::dots_f16(self.isa, a, pool, starts, out)
    }

    /// [`CpuContext::axpy`] of each `w[p]` with the row of `pool` at `starts[p]` (each as long
    /// as `y`), in turn: the same result, `y` read and written once.
    ///
    /// # Panics
    /// When a row runs past the pool or `w` is shorter than `starts`.
    pub fn axpys(&self, w: &[f32], pool: &[f32], starts: &[usize], y: &mut [f32]) {
        dispatch::axpys_f32(self.isa, w, pool, starts, y)
    }

    /// [`CpuContext::axpys`] over an f16 pool.
    ///
    /// # Panics
    /// As [`CpuContext::axpys`].
    pub fn axpys_f16(&self, w: &[f32], pool: &[half::f16], starts: &[usize], y: &mut [f32]) {
        dispatch::axpys_f16(self.isa, w, pool, starts, y)
    }

    /// `out[e] = q[e] · scale`: an INT8 cache's row widened. Fills `out[..q.len()]`, as far
    /// as `out` goes.
    pub fn widen_i8(&self, q: &[i8], scale: f32, out: &mut [f32]) {
        dispatch::widen_i8(self.isa, q, scale, out)
    }

    /// `out[e] = level e · scale + zero` (a product, then a sum) for the 4-bit levels of
    /// `packed`, two a byte (element 2i in byte i's low nibble, 2i + 1 in its high nibble):
    /// an INT4 cache's row widened. Fills `out[..2 · packed.len()]`, as far as `out` goes.
    pub fn widen_u4(&self, packed: &[u8], scale: f32, zero: f32, out: &mut [f32]) {
        dispatch::widen_u4(self.isa, packed, scale, zero, out)
    }

    /// `s[i] = e^(s[i] − shift)`, returning their sum (eight lanes summed in order, then the
    /// rest): a softmax's terms.
    pub fn exps(&self, s: &mut [f32], shift: f32) -> f32 {
        vector::exps(s, shift)
    }

    /// Runs `f` on this backend's pool: rayon's parallel iterators inside it use these
    /// threads (how crates above, such as the attention kernels, share the pool).
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }

    /// Runs a model step `f` on one of the pool's threads while the others wait for its
    /// parallel loops awake, as [`keep_awake`] says; they go back to rayon's idle policy when
    /// `f` returns.
    pub(crate) fn step<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        let done = AtomicBool::new(false);
        self.pool.install(|| {
            let home = rayon::current_thread_index();
            beside(self.threads() - 1, &done, home, f)
        })
    }
}

/// `f` on this thread with `n` [`keep_awake`] jobs beside it, `done` set when `f` returns or
/// unwinds (else a panic in a step would leave the jobs spinning and the step's `join`s
/// waiting for them): each job the other half of a [`rayon::join`], so on the stack (a
/// scope's spawned jobs are boxed, an allocation a thread a step). `n` nested joins deep: a
/// few hundred bytes of stack a pool thread.
fn beside<R: Send>(
    n: usize,
    done: &AtomicBool,
    home: Option<usize>,
    f: impl FnOnce() -> R + Send,
) -> R {
    if n == 0 {
        let _done = SetOnDrop(done);
        return f();
    }
    rayon::join(|| beside(n - 1, done, home, f), || keep_awake(done, home)).0
}

/// Sets its flag when dropped.
struct SetOnDrop<'a>(&'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Idle rounds of [`keep_awake`] between its yields of the core to the OS.
const ROUNDS_PER_OS_YIELD: u32 = 1 << 12;

/// Until `done`, runs the pool's pending jobs (a step's parallel loops) as they appear,
/// pausing the core between looks instead of going to sleep: between two of a step's loops
/// rayon's idle policy (a few dozen `sched_yield`s, then a futex wait) put a thread to sleep
/// about twice a decode layer, and each wake-up cost a system call and a thread switch. The
/// core is still offered to the OS every [`ROUNDS_PER_OS_YIELD`] idle rounds, so that the
/// front doors' threads are not kept waiting. A job that lands on
/// the step's own thread (`home`) returns at once: that thread is running the step.
fn keep_awake(done: &AtomicBool, home: Option<usize>) {
    if rayon::current_thread_index() == home {
        return;
    }
    let mut idle = 0u32;
    while !done.load(Ordering::Acquire) {
        match rayon::yield_now() {
            Some(rayon::Yield::Executed) => idle = 0,
            Some(rayon::Yield::Idle) | None => {
                idle = idle.wrapping_add(1);
                if idle.is_multiple_of(ROUNDS_PER_OS_YIELD) {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::dot::{Rows, rows_portable};
    use super::*;
    use crate::DType;
    use rand::{Rng, SeedableRng};

    /// Random rows of `dtype` whose f16 scales are finite and small.
    fn random_rows(dtype: DType, n: usize, k: usize, rng: &mut impl Rng) -> Vec<u8> {
        let f = dtype.format();
        let mut w: Vec<u8> = (0..n * k / f.block_elems * f.block_bytes)
            .map(|_| rng.random())
            .collect();
        for blk in w.chunks_exact_mut(f.block_bytes) {
            for &at in f.scale_offsets {
                let v = half::f16::from_f32(rng.random_range(-0.05f32..0.05));
                blk[at..at + 2].copy_from_slice(&v.to_le_bytes());
            }
            if dtype == DType::MXFP4 {
                // An E8M0 exponent of scales 2^-13 .. 2^-4 (its largest quant 12).
                blk[0] = rng.random_range(115..=124);
            }
        }
        w
    }

    fn rows_of(dtype: DType, w: &[u8], k: usize) -> Rows<'_> {
        let f = dtype.format();
        Rows {
            dtype,
            ints: f.ints.as_ref().unwrap(),
            block_bytes: f.block_bytes,
            groups_per_block: f.block_elems / 32,
            row_bytes: k / f.block_elems * f.block_bytes,
            w,
        }
    }

    /// The block formats the integer kernels read (FP8 has no integer form: its rows take
    /// the float path).
    fn block_dtypes() -> impl Iterator<Item = DType> {
        DType::WEIGHTS
            .iter()
            .copied()
            .filter(|d| d.is_quantized() && d.format().ints.is_some())
    }

    /// Every ISA this CPU runs gives the portable kernel's bits, at every batch size, and a
    /// row's result does not depend on the rows of X beside it.
    #[test]
    fn every_isa_matches_the_portable_kernel_bit_for_bit() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for dtype in block_dtypes() {
            let k = if dtype.is_k_quant() { 512 } else { 96 };
            let n = 7;
            let w = random_rows(dtype, n, k, &mut rng);
            let rows = rows_of(dtype, &w, k);
            for m in [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 15, 16, 17, 25, 33] {
                let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-2.0..2.0)).collect();
                let mut qx = QuantX::default();
                qx.fill(&x, m, k);
                let mut want = vec![0f32; n * m];
                rows_portable(&rows, &qx, &mut want);
                for isa in Isa::available() {
                    let mut got = vec![0f32; n * m];
                    dispatch::rows(isa, &rows, &qx, &mut got);
                    let same = want
                        .iter()
                        .zip(&got)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{dtype:?} m={m} {isa}: {got:?} vs portable {want:?}");
                }
                // Batch invariance: each row of X alone gives the same bits.
                for i in 0..m {
                    let mut one = QuantX::default();
                    one.fill(&x[i * k..(i + 1) * k], 1, k);
                    let mut alone = vec![0f32; n];
                    dispatch::rows(Isa::detect(), &rows, &one, &mut alone);
                    for r in 0..n {
                        assert_eq!(
                            alone[r].to_bits(),
                            want[r * m + i].to_bits(),
                            "{dtype:?} row {r} of X row {i}: batch of {m} vs alone"
                        );
                    }
                }
            }
        }
    }

    /// The portable kernel is the dot product of the dequantized weight with the dequantized
    /// X (what the quants stand for), up to f32 rounding.
    #[test]
    fn portable_kernel_matches_the_dequantized_product() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        for dtype in block_dtypes() {
            let k = if dtype.is_k_quant() { 768 } else { 160 };
            let (n, m) = (5, 3);
            let w = random_rows(dtype, n, k, &mut rng);
            let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-2.0..2.0)).collect();
            let mut qx = QuantX::default();
            qx.fill(&x, m, k);
            let xd = qx.dequantized();
            let mut got = vec![0f32; n * m];
            rows_portable(&rows_of(dtype, &w, k), &qx, &mut got);
            let mut wd = vec![0f32; n * k];
            crate::quant::dequantize(dtype, &w, &mut wd).unwrap();
            for r in 0..n {
                for i in 0..m {
                    let (mut want, mut mag) = (0f64, 0f64);
                    for e in 0..k {
                        let p = f64::from(wd[r * k + e]) * f64::from(xd[i * k + e]);
                        want += p;
                        mag += p.abs();
                    }
                    let v = f64::from(got[r * m + i]);
                    assert!(
                        (v - want).abs() <= 1e-5 * mag + 1e-6,
                        "{dtype:?} row {r} X row {i}: {v} vs {want} (sum of |terms| {mag})"
                    );
                }
            }
        }
    }

    /// X's quantization is ggml's `Q8_0`: amax / 127 (kept at f16 precision), rounded half away
    /// from zero.
    #[test]
    fn activations_quantize_as_q8_0() {
        let mut x = vec![0f32; 32];
        x[0] = 127.0;
        x[1] = -63.5;
        x[2] = 0.5;
        x[17] = 2.4;
        let mut qx = QuantX::default();
        qx.fill(&x, 1, 32);
        assert_eq!(qx.d[0], 1.0);
        assert_eq!(&qx.quants(0, 0)[..3], &[127, -64, 1]);
        assert_eq!(qx.quants(0, 0)[17], 2);
        assert_eq!(qx.sums(0), [127 - 64 + 1, 2]);
        // In a tile of several rows, the same row's quants, scale and sums are the same.
        let mut two = x.clone();
        two.extend((0..32).map(|v| v as f32));
        let mut qx2 = QuantX::default();
        qx2.fill(&two, 2, 32);
        assert_eq!(qx2.quants(0, 0), qx.quants(0, 0));
        assert_eq!(qx2.sums(qx2.slot(0, 0)), qx.sums(0));
        assert_eq!(qx2.quants(1, 0)[31], 127);
    }

    /// The many-row helpers give the bits of one call a row, at every ISA, for row lengths
    /// with and without a tail and past one chunk, and more rows than one batch.
    #[test]
    fn many_row_vector_helpers_are_single_calls_bit_for_bit() {
        use half::f16;
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for d in [1, 7, 8, 13, 64, 67, 256] {
            let rows = 70;
            let pool: Vec<f32> = (0..rows * d + 5)
                .map(|_| rng.random_range(-2.0..2.0))
                .collect();
            let hpool: Vec<f16> = pool.iter().map(|&v| f16::from_f32(v)).collect();
            // Rows out of order, one twice, at offsets that are not multiples of d.
            let mut starts: Vec<usize> = (0..rows).rev().map(|r| r * d + 3).collect();
            starts.push(5);
            let a: Vec<f32> = (0..d).map(|_| rng.random_range(-2.0..2.0)).collect();
            let w: Vec<f32> = starts.iter().map(|_| rng.random_range(-1.0..1.0)).collect();
            for isa in Isa::available() {
                let mut got = vec![0f32; starts.len()];
                dispatch::dots_f32(isa, &a, &pool, &starts, &mut got);
                let mut got_h = vec![0f32; starts.len()];
                dispatch::dots_f16(isa, &a, &hpool, &starts, &mut got_h);
                for (p, &s) in starts.iter().enumerate() {
                    let one = dispatch::dot_f32(isa, &a, &pool[s..s + d]);
                    assert_eq!(got[p].to_bits(), one.to_bits(), "{isa} d={d} row {p}");
                    let one = dispatch::dot_f16(isa, &a, &hpool[s..s + d]);
                    assert_eq!(got_h[p].to_bits(), one.to_bits(), "{isa} d={d} row {p}");
                }
                let (mut y, mut want) = (a.clone(), a.clone());
                dispatch::axpys_f32(isa, &w, &pool, &starts, &mut y);
                for (&w, &s) in w.iter().zip(&starts) {
                    dispatch::axpy_f32(isa, w, &pool[s..s + d], &mut want);
                }
                assert_eq!(y, want, "{isa} d={d}");
                let (mut y, mut want) = (a.clone(), a.clone());
                dispatch::axpys_f16(isa, &w, &hpool, &starts, &mut y);
                for (&w, &s) in w.iter().zip(&starts) {
                    dispatch::axpy_f16(isa, w, &hpool[s..s + d], &mut want);
                }
                assert_eq!(y, want, "{isa} d={d}");
            }
        }
    }

    /// The vector helpers give the portable form's bits at every ISA, for f32 and f16 rows
    /// of lengths with and without a tail; the f16 forms are the f32 ones of the widened row.
    #[test]
    fn vector_helpers_match_the_portable_forms_bit_for_bit() {
        use half::f16;
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for n in [1, 7, 8, 13, 64, 67] {
            let a: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0..2.0)).collect();
            let b: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0..2.0)).collect();
            let h: Vec<f16> = b.iter().map(|&v| f16::from_f32(v)).collect();
            let hw: Vec<f32> = h.iter().map(|v| v.to_f32()).collect();
            let want = vector::dot_portable(&a, &b);
            let want_h = vector::dot_portable(&a, &hw);
            let mut y = a.clone();
            vector::axpy_portable(0.37, &b, &mut y);
            let mut yh = a.clone();
            vector::axpy_portable(0.37, &hw, &mut yh);
            for isa in Isa::available() {
                assert_eq!(
                    dispatch::dot_f32(isa, &a, &b).to_bits(),
                    want.to_bits(),
                    "{isa} {n}"
                );
                assert_eq!(
                    dispatch::dot_f16(isa, &a, &h).to_bits(),
                    want_h.to_bits(),
                    "{isa} {n}"
                );
                let mut got = a.clone();
                dispatch::axpy_f32(isa, 0.37, &b, &mut got);
                assert_eq!(got, y, "{isa} {n}");
                let mut got = a.clone();
                dispatch::axpy_f16(isa, 0.37, &h, &mut got);
                assert_eq!(got, yh, "{isa} {n}");
            }
            let exact: f64 = a
                .iter()
                .zip(&b)
                .map(|(&x, &y)| f64::from(x) * f64::from(y))
                .sum();
            assert!(
                (f64::from(want) - exact).abs() < 1e-4 * n as f64,
                "{want} vs {exact}"
            );
        }
    }

    /// INT8 values and 4-bit levels widen to the portable forms' bits at every ISA, for rows
    /// with and without a tail past the last whole eight bytes, each level in the nibble it
    /// names.
    #[test]
    fn widened_rows_match_the_portable_forms_bit_for_bit() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        for bytes in [1, 4, 8, 13, 32, 128] {
            let q: Vec<i8> = (0..bytes).map(|_| rng.random()).collect();
            let scale = rng.random_range(0.001..0.1);
            let mut want = vec![0f32; bytes];
            vector::widen_i8_portable(&q, scale, &mut want);
            for (e, w) in want.iter().enumerate() {
                assert_eq!(*w, f32::from(q[e]) * scale, "element {e}");
            }
            for isa in Isa::available() {
                let mut got = vec![0f32; bytes];
                dispatch::widen_i8(isa, &q, scale, &mut got);
                assert_eq!(got, want, "{isa} {bytes} values");
            }
            let packed: Vec<u8> = (0..bytes).map(|_| rng.random()).collect();
            let (scale, zero) = (rng.random_range(0.01..0.5), rng.random_range(-2.0..2.0));
            let mut want = vec![0f32; 2 * bytes];
            vector::widen_u4_portable(&packed, scale, zero, &mut want);
            for (e, w) in want.iter().enumerate() {
                let level = (packed[e / 2] >> (4 * (e % 2))) & 15;
                assert_eq!(*w, f32::from(level) * scale + zero, "element {e}");
            }
            for isa in Isa::available() {
                let mut got = vec![0f32; 2 * bytes];
                dispatch::widen_u4(isa, &packed, scale, zero, &mut got);
                assert_eq!(got, want, "{isa} {bytes} bytes");
            }
        }
    }

    #[test]
    fn isa_names_parse_and_unknown_ones_are_errors() {
        assert_eq!("AVX2".parse::<Isa>().unwrap(), Isa::Avx2);
        let e = "neon".parse::<Isa>().unwrap_err().to_string();
        assert!(
            e.contains("neon") && e.contains("scalar, avx2 or avx512"),
            "{e}"
        );
    }

    #[test]
    fn a_step_that_panics_ends_with_its_panic_and_the_pool_goes_on() {
        let ctx = CpuContext::new(&DeviceOptions {
            threads: Some(3),
            ..DeviceOptions::default()
        })
        .unwrap();
        for _ in 0..4 {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                ctx.step(|| -> u32 { panic!("a step's panic") })
            }));
            assert!(r.is_err());
        }
        assert_eq!(ctx.step(|| 7), 7);
    }
}
