// Y[x_row0 + i, n_offset + r] = sum_c X[i, c] * W[r, c] (+ bias) for CPU-type adapters
// (lavapipe, SwiftShader): compilers there run invocations as SIMD lanes and turn every
// storage read into a per-lane loop, so this kernel gives each invocation R whole rows of W
// (one 16-byte read per block of quants) and reads X from a uniform binding at
// workgroup-uniform offsets, which becomes one broadcast load. MV_M rows of X a launch; the
// caller binds the rows this launch covers. W is a block format (any of DType's Q*) in the
// device layout of quant/layout.rs, its quants 16-byte aligned; K-quants are read one
// 32-element sub-block at a time.
//
// What saves a launch each: NORM applies an RMSNorm to X's rows first (X·diag(g), each row's
// products scaled by 1/sqrt(mean(x²) + eps) at the end, g bound like X); RES adds a residual
// of Y's shape (Y = RES + X·Wᵀ); GATED reads W as the stack [gate; up] of 2·n1 rows and writes
// glu(X·gateᵀ, X·upᵀ) (a gated MLP; glu.wgsl's activation). Y may be wider
// than the product: its row stride is n_total and the product's columns start at n_offset.

struct Params {
    m: u32,
    k: u32,
    // Output rows of this launch (a chunk's rows; under GATED, gate rows).
    rows: u32,
    n_total: u32,
    n_offset: u32,
    qs: u32,
    x_row0: u32,
    // GATED: the up rows start at row n1 of W.
    n1: u32,
    // NORM: the RMSNorm's epsilon.
    eps: f32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

const MV_M: u32 = {{MV_M}}u;
const R: u32 = {{R}}u;
const WG: u32 = {{WG}}u;

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<uniform> xu: array<vec4<f32>, {{XV}}>;
@group(0) @binding(2) var<storage, read> wq: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
#if BIAS
@group(0) @binding(4) var<storage, read> bias: array<f32>;
#endif
#if RES
@group(0) @binding(4) var<storage, read> res: array<f32>;
#endif
#if NORM
@group(0) @binding({{G_BINDING}}) var<uniform> gu: array<vec4<f32>, {{GV}}>;
#endif

// One block of 32 weights, dequantized: value j of the block is component j % 4 of q{j / 4}.
struct Blk {
    q0: vec4<f32>,
    q1: vec4<f32>,
    q2: vec4<f32>,
    q3: vec4<f32>,
    q4: vec4<f32>,
    q5: vec4<f32>,
    q6: vec4<f32>,
    q7: vec4<f32>,
}

// Through i32: a signed conversion is one instruction on x86, an unsigned one is several.
fn nib4(x: u32) -> vec4<f32> {
    return vec4<f32>(bitcast<vec4<i32>>(vec4<u32>(x, x >> 8u, x >> 16u, x >> 24u) & vec4<u32>(0xfu)));
}

fn two4(x: u32) -> vec4<f32> {
    return vec4<f32>(bitcast<vec4<i32>>(vec4<u32>(x, x >> 8u, x >> 16u, x >> 24u) & vec4<u32>(3u)));
}

fn bit4(x: u32) -> vec4<f32> {
    return vec4<f32>(bitcast<vec4<i32>>(vec4<u32>(x, x >> 1u, x >> 2u, x >> 3u) & vec4<u32>(1u)));
}

// Under QSUM (Q8_0, and the 4-bit formats without high bits: Q4_0, Q4_1, Q4_Z and Q4_K) a
// block is its quants and its (d, m), value = q·d + m, and a row's products are summed as
// d·Σ q·x + m·Σ x (Σ x once a block of X for all rows): no multiply or multiply-add an
// element for d and m. The quants stay scaled where a mask leaves them, and X or d is scaled
// back (`xprep`, the decoders): by powers of two, so every product q·x is as unscaled.
#if QSUM
struct QBlk {
    q: Blk,
    d: f32,
    m: f32,
}

fn bsum(x: Blk) -> f32 {
    return dot((x.q0 + x.q1) + (x.q2 + x.q3) + ((x.q4 + x.q5) + (x.q6 + x.q7)), vec4<f32>(1.0));
}

// Block w's products with X block x (after xprep) whose values sum to xs.
fn qdot(w: QBlk, x: Blk, xs: f32) -> f32 {
    return w.d * bdot(w.q, x) + w.m * xs;
}

alias WBlk = QBlk;
#else
alias WBlk = Blk;
#endif

// NIB (the 4-bit formats): component c of each vec4 is the nibble of byte c as q·256^c (a
// mask, no shift), and X is read scaled by 256^-c to match.
#if NIB
fn nib_at(x: u32) -> vec4<f32> {
    return vec4<f32>(bitcast<vec4<i32>>(vec4<u32>(x) & vec4<u32>(0xfu, 0xf00u, 0xf0000u, 0xf000000u)));
}

fn nib_w(v: vec4<u32>, d: f32, m: f32) -> QBlk {
    let hi = v >> vec4<u32>(4u);
    return QBlk(Blk(nib_at(v.x), nib_at(v.y), nib_at(v.z), nib_at(v.w), nib_at(hi.x),
        nib_at(hi.y), nib_at(hi.z), nib_at(hi.w)), d, m);
}

fn xprep(x: Blk) -> Blk {
    let s = vec4<f32>(1.0, 0.00390625, 1.52587890625e-05, 5.9604644775390625e-08);
    return Blk(x.q0 * s, x.q1 * s, x.q2 * s, x.q3 * s, x.q4 * s, x.q5 * s, x.q6 * s, x.q7 * s);
}
#endif

// The 32 high bits h as 16·bit, in Blk order.
fn hbits(h: u32) -> Blk {
    return Blk(bit4(h) * 16.0, bit4(h >> 4u) * 16.0, bit4(h >> 8u) * 16.0, bit4(h >> 12u) * 16.0,
        bit4(h >> 16u) * 16.0, bit4(h >> 20u) * 16.0, bit4(h >> 24u) * 16.0, bit4(h >> 28u) * 16.0);
}

// 5-bit quants (nibbles v plus high bits h) as q·d + m.
fn q5_blk(v: vec4<u32>, h: u32, d: f32, m: f32) -> Blk {
    let hi = v >> vec4<u32>(4u);
    return Blk((nib4(v.x) + bit4(h) * 16.0) * d + m, (nib4(v.y) + bit4(h >> 4u) * 16.0) * d + m,
        (nib4(v.z) + bit4(h >> 8u) * 16.0) * d + m, (nib4(v.w) + bit4(h >> 12u) * 16.0) * d + m,
        (nib4(hi.x) + bit4(h >> 16u) * 16.0) * d + m, (nib4(hi.y) + bit4(h >> 20u) * 16.0) * d + m,
        (nib4(hi.z) + bit4(h >> 24u) * 16.0) * d + m, (nib4(hi.w) + bit4(h >> 28u) * 16.0) * d + m);
}

// 2-bit quants (words lo for elements 0-15, hi for 16-31) as q·d + m, with d0/m0 for the first
// 16 elements and d1/m1 for the rest.
fn two_blk(lo: u32, hi: u32, d0: f32, m0: f32, d1: f32, m1: f32) -> Blk {
    return Blk(two4(lo) * d0 + m0, two4(lo >> 2u) * d0 + m0, two4(lo >> 4u) * d0 + m0,
        two4(lo >> 6u) * d0 + m0, two4(hi) * d1 + m1, two4(hi >> 2u) * d1 + m1,
        two4(hi >> 4u) * d1 + m1, two4(hi >> 6u) * d1 + m1);
}

// Byte j (0..16) of the four words v.
fn byte4(v: vec4<u32>, j: u32) -> u32 {
    return (v[j / 4u] >> (8u * (j % 4u))) & 0xffu;
}

// The vec4 indices a block reads (RD of them: 2, 3 or 4; under HEAD1, the head's component
// in the last) for the chunk whose quants start at word qs, and the block from those reads.
// b numbers 32-element (sub-)blocks; the K-quants' super-block is b / 8, its sub-block b % 8.
// Layouts: quant/layout.rs.
#if W_Q8_0
fn blk_idx(b: u32, qs: u32) -> vec4<u32> {
    let q = (qs >> 2u) + 2u * b;
    return vec4<u32>(b >> 3u, q, q + 1u, (b >> 1u) & 3u);
}
// Each signed byte moved to the top byte of its word (q·2^24: a shift and a mask), and d
// scaled by 2^-24 to match; X as it is.
fn i8_top(x: u32) -> vec4<f32> {
    let t = vec4<u32>(x << 24u, x << 16u, x << 8u, x) & vec4<u32>(0xff000000u);
    return vec4<f32>(bitcast<vec4<i32>>(t));
}
fn decode(b: u32, v0: vec4<u32>, v1: vec4<u32>, v2: vec4<u32>, v3: vec4<u32>) -> QBlk {
    let d = unpack2x16float(v0.x)[b & 1u] * 5.9604644775390625e-08;
    return QBlk(Blk(i8_top(v1.x), i8_top(v1.y), i8_top(v1.z), i8_top(v1.w), i8_top(v2.x),
        i8_top(v2.y), i8_top(v2.z), i8_top(v2.w)), d, 0.0);
}
fn xprep(x: Blk) -> Blk {
    return x;
}
#endif
#if W_Q4_0
fn blk_idx(b: u32, qs: u32) -> vec4<u32> {
    return vec4<u32>(b >> 3u, (qs >> 2u) + b, 0u, (b >> 1u) & 3u);
}
fn decode(b: u32, v0: vec4<u32>, v1: vec4<u32>, v2: vec4<u32>, v3: vec4<u32>) -> QBlk {
    let d = unpack2x16float(v0.x)[b & 1u];
    return nib_w(v1, d, -8.0 * d);
}
#endif
// (d, m) of a block's head word, for value = q·d + m: Q4_1's d|m as it is; the zero-point
// formats' d|z as (d, −z·d), one multiply-add an element instead of a subtract and a
// multiply. Exact for the small integer zero points checkpoints have (q·d and z·d are then
// exact in f32, and so is their sum); otherwise within an ulp of (q − z)·d.
#if W_Q4_1
fn head_dm(h: u32) -> vec2<f32> {
    return unpack2x16float(h);
}
#endif
#if W_ZP
fn head_dm(h: u32) -> vec2<f32> {
    let dz = unpack2x16float(h);
    return vec2<f32>(dz.x, -dz.y * dz.x);
}
#endif
#if W_Q4_DM
fn blk_idx(b: u32, qs: u32) -> vec4<u32> {
    return vec4<u32>(b >> 2u, (qs >> 2u) + b, 0u, b & 3u);
}
fn decode(b: u32, v0: vec4<u32>, v1: vec4<u32>, v2: vec4<u32>, v3: vec4<u32>) -> QBlk {
    let dm = head_dm(v0.x);
    return nib_w(v1, dm.x, dm.y);
}
#endif
#if W_Q8_Z
fn u8x4(x: u32) -> vec4<f32> {
    return vec4<f32>(bitcast<vec4<i32>>(vec4<u32>(x, x >> 8u, x >> 16u, x >> 24u) & vec4<u32>(0xffu)));
}
fn blk_idx(b: u32, qs: u32) -> vec4<u32> {
    let q = (qs >> 2u) + 2u * b;
    return vec4<u32>(b >> 2u, q, q + 1u, b & 3u);
}
fn decode(b: u32, v0: vec4<u32>, v1: vec4<u32>, v2: vec4<u32>, v3: vec4<u32>) -> Blk {
    let dm = head_dm(v0.x);
    return Blk(u8x4(v1.x) * dm.x + dm.y, u8x4(v1.y) * dm.x + dm.y, u8x4(v1.z) * dm.x + dm.y,
        u8x4(v1.w) * dm.x + dm.y, u8x4(v2.x) * dm.x + dm.y, u8x4(v2.y) * dm.x + dm.y,
        u8x4(v2.z) * dm.x + dm.y, u8x4(v2.w) * dm.x + dm.y);
}
#endif
#if W_Q5_0
fn blk_idx(b: u32, qs: u32) -> vec4<u32> {
    return vec4<u32>(b >> 1u, (qs >> 2u) + b, 0u, 0u);
}
fn decode(b: u32, v0: vec4<u32>, v1: vec4<u32>, v2: vec4<u32>, v3: vec4<u32>) -> Blk {
    let o = 2u * (b & 1u);
    let d = unpack2x16float(v0[o]).x;
    return q5_blk(v1, v0[o + 1u], d, -16.0 * d);
}
#endif
#if W_Q5_1
fn blk_idx(b: u32, qs: u32) -> vec4<u32> {
    return vec4<u32>(b >> 1u, (qs >> 2u) + b, 0u, 0u);
}
fn decode(b: u32, v0: vec4<u32>, v1: vec4<u32>, v2: vec4<u32>, v3: vec4<u32>) -> Blk {
    let o = 2u * (b & 1u);
    let dm = unpack2x16float(v0[o]);
    return q5_blk(v1, v0[o + 1u], dm.x, dm.y);
}
#endif
#if W_Q2_K
fn blk_idx(b: u32, qs: u32) -> vec4<u32> {
    let sb = b >> 3u;
    let base = (qs >> 2u) + 5u * sb;
    return vec4<u32>(sb >> 2u, base, base + 1u + ((b & 7u) >> 1u), 0u);
}
fn decode(b: u32, v0: vec4<u32>, v1: vec4<u32>, v2: vec4<u32>, v3: vec4<u32>) -> Blk {
    let s = b & 7u;
    let dm = unpack2x16float(v0[(b >> 3u) & 3u]);
    let sc0 = byte4(v1, 2u * s);
    let sc1 = byte4(v1, 2u * s + 1u);
    let o = 2u * (s & 1u);
    return two_blk(v2[o], v2[o + 1u], dm.x * f32(sc0 & 0xfu), -dm.y * f32(sc0 >> 4u),
        dm.x * f32(sc1 & 0xfu), -dm.y * f32(sc1 >> 4u));
}
#endif
#if W_Q3_K
fn blk_idx(b: u32, qs: u32) -> vec4<u32> {
    let sb = b >> 3u;
    let s = b & 7u;
    let base = (qs >> 2u) + 6u * sb;
    return vec4<u32>(sb, base + (s >> 2u), base + 2u + (s >> 1u), 0u);
}
fn scale3(h: vec4<u32>, i: u32) -> f32 {
    let low = (byte4(h, i % 8u) >> (4u * (i / 8u))) & 0xfu;
    let high = (byte4(h, 8u + i % 4u) >> (2u * (i / 4u))) & 3u;
    return f32(i32(low | (high << 4u)) - 32);
}
fn decode(b: u32, v0: vec4<u32>, v1: vec4<u32>, v2: vec4<u32>, v3: vec4<u32>) -> Blk {
    let s = b & 7u;
    let d = unpack2x16float(v0.w).x;
    let d0 = d * scale3(v0, 2u * s);
    let d1 = d * scale3(v0, 2u * s + 1u);
    let o = 2u * (s & 1u);
    // q = low − 4 + 4·high: the 2-bit part with offset −4 plus hbits/4.
    let lo = two_blk(v2[o], v2[o + 1u], d0, -4.0 * d0, d1, -4.0 * d1);
    let h = hbits(v1[s & 3u]);
    let e0 = 0.25 * d0;
    let e1 = 0.25 * d1;
    return Blk(lo.q0 + h.q0 * e0, lo.q1 + h.q1 * e0, lo.q2 + h.q2 * e0, lo.q3 + h.q3 * e0,
        lo.q4 + h.q4 * e1, lo.q5 + h.q5 * e1, lo.q6 + h.q6 * e1, lo.q7 + h.q7 * e1);
}
#endif
#if W_Q45_K
fn scale_min(h: vec4<u32>, j: u32) -> vec2<f32> {
    // The 12 scale bytes follow the d|dmin word: byte j of them is byte j + 4 of h.
    if (j < 4u) {
        return vec2<f32>(f32(byte4(h, j + 4u) & 63u), f32(byte4(h, j + 8u) & 63u));
    }
    let sc = (byte4(h, j + 8u) & 0xfu) | ((byte4(h, j) >> 6u) << 4u);
    let m = (byte4(h, j + 8u) >> 4u) | ((byte4(h, j + 4u) >> 6u) << 4u);
    return vec2<f32>(f32(sc), f32(m));
}
#endif
#if W_Q4_K
fn blk_idx(b: u32, qs: u32) -> vec4<u32> {
    return vec4<u32>(b >> 3u, (qs >> 2u) + b, 0u, 0u);
}
fn decode(b: u32, v0: vec4<u32>, v1: vec4<u32>, v2: vec4<u32>, v3: vec4<u32>) -> QBlk {
    let dm = unpack2x16float(v0.x);
    let scm = scale_min(v0, b & 7u);
    return nib_w(v1, dm.x * scm.x, -dm.y * scm.y);
}
#endif
#if W_Q5_K
fn blk_idx(b: u32, qs: u32) -> vec4<u32> {
    let sb = b >> 3u;
    let s = b & 7u;
    let base = (qs >> 2u) + 10u * sb;
    return vec4<u32>(sb, base + 2u + s, base + (s >> 2u), 0u);
}
fn decode(b: u32, v0: vec4<u32>, v1: vec4<u32>, v2: vec4<u32>, v3: vec4<u32>) -> Blk {
    let dm = unpack2x16float(v0.x);
    let scm = scale_min(v0, b & 7u);
    return q5_blk(v1, v2[b & 3u], dm.x * scm.x, -dm.y * scm.y);
}
#endif
#if W_Q6_K
fn blk_idx(b: u32, qs: u32) -> vec4<u32> {
    let sb = b >> 3u;
    let s = b & 7u;
    let base = (qs >> 2u) + 13u * sb;
    return vec4<u32>(sb >> 3u, base, base + 1u + s, base + 9u + (s >> 1u));
}
fn decode(b: u32, v0: vec4<u32>, v1: vec4<u32>, v2: vec4<u32>, v3: vec4<u32>) -> Blk {
    let sb = b >> 3u;
    let s = b & 7u;
    let d = unpack2x16float(v0[(sb >> 1u) & 3u])[sb & 1u];
    let i = 2u * s;
    let sw = v1[i / 4u];
    let sh = 8u * (i % 4u);
    let d0 = d * f32(bitcast<i32>(sw << (24u - sh)) >> 24u);
    let d1 = d * f32(bitcast<i32>(sw << (16u - sh)) >> 24u);
    // q = low nibble + 16·(2-bit high) − 32.
    let o = 2u * (s & 1u);
    let hi = two_blk(v3[o], v3[o + 1u], 16.0 * d0, -32.0 * d0, 16.0 * d1, -32.0 * d1);
    let l = v2 >> vec4<u32>(4u);
    return Blk(nib4(v2.x) * d0 + hi.q0, nib4(v2.y) * d0 + hi.q1, nib4(v2.z) * d0 + hi.q2,
        nib4(v2.w) * d0 + hi.q3, nib4(l.x) * d1 + hi.q4, nib4(l.y) * d1 + hi.q5,
        nib4(l.z) * d1 + hi.q6, nib4(l.w) * d1 + hi.q7);
}
#endif

// Block b of the weight bound as `wq` (quants at word p.qs). Under HEAD1 (one head word a
// block: Q8_0, Q4_0, Q4_1 and the zero-point formats) only that word is read, component i.w
// of vec4 i.x, into v0.x: these compilers load storage one invocation and one component at
// a time, so a whole vec4 of heads cost four times the loads of the word a block uses.
fn load_blk(b: u32) -> WBlk {
    let i = blk_idx(b, p.qs);
#if HEAD1
    let v0 = vec4<u32>(wq[i.x][i.w]);
#else
    let v0 = wq[i.x];
#endif
    let v1 = wq[i.y];
#if RD3
    let v2 = wq[i.z];
#else
    let v2 = v1;
#endif
#if RD4
    let v3 = wq[i.w];
#else
    let v3 = v1;
#endif
    return decode(b, v0, v1, v2, v3);
}

// Block `blk` of row r.
fn load_row(r: u32, blk: u32, nb: u32) -> WBlk {
    return load_blk(r * nb + blk);
}

// The 32 values of X at vec4 index xb. With SG_X (subgroups of at least 8 lanes), lane j
// reads vec4 j & 7 and the others take it by broadcast: one gather a block instead of eight,
// which is what these compilers make of a uniform-buffer read at a loop-dependent offset.
#if SG_X
fn bcast(v: vec4<f32>) -> Blk {
    return Blk(subgroupBroadcast(v, 0u), subgroupBroadcast(v, 1u), subgroupBroadcast(v, 2u),
        subgroupBroadcast(v, 3u), subgroupBroadcast(v, 4u), subgroupBroadcast(v, 5u),
        subgroupBroadcast(v, 6u), subgroupBroadcast(v, 7u));
}
fn xblk(xb: u32, lane: u32) -> Blk {
    return bcast(xu[xb + (lane & 7u)]);
}
#if NORM
fn gblk(gb: u32, lane: u32) -> Blk {
    return bcast(gu[gb + (lane & 7u)]);
}
#endif
#else
fn xblk(xb: u32, lane: u32) -> Blk {
    return Blk(xu[xb], xu[xb + 1u], xu[xb + 2u], xu[xb + 3u], xu[xb + 4u], xu[xb + 5u],
        xu[xb + 6u], xu[xb + 7u]);
}
#if NORM
fn gblk(gb: u32, lane: u32) -> Blk {
    return Blk(gu[gb], gu[gb + 1u], gu[gb + 2u], gu[gb + 3u], gu[gb + 4u], gu[gb + 5u],
        gu[gb + 6u], gu[gb + 7u]);
}
#endif
#endif

// Elementwise product of two blocks (X by the norm's weights).
fn bmul(a: Blk, b: Blk) -> Blk {
    return Blk(a.q0 * b.q0, a.q1 * b.q1, a.q2 * b.q2, a.q3 * b.q3, a.q4 * b.q4, a.q5 * b.q5,
        a.q6 * b.q6, a.q7 * b.q7);
}

fn bdot(w: Blk, x: Blk) -> f32 {
    return dot(w.q0, x.q0) + dot(w.q1, x.q1) + dot(w.q2, x.q2) + dot(w.q3, x.q3)
        + dot(w.q4, x.q4) + dot(w.q5, x.q5) + dot(w.q6, x.q6) + dot(w.q7, x.q7);
}

// The MV_M x R accumulators are plain variables `a{i}_{rr}` and the loops over them are
// written out by the host (ACC_DECL, ACC_BODY, ACC_STORE): indexing a private array with a
// loop counter would put it in memory on these compilers.
@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    {{SG_ARG}}
) {
    // No early exit: every invocation takes part in the broadcasts; rows past the end compute
    // a copy of the last row and are not written.
    let r0 = ((wid.x + wid.y * nwg.x) * WG + lid) * R;
    let lane = {{SG_LANE}};
    let nb = p.k / 32u;
    let kv = p.k / 4u;
    let last = p.rows - 1u;
    {{ACC_DECL}}
    for (var blk = 0u; blk < nb; blk++) {
        let xb = blk * 8u;
#if NORM
        let g = gblk(xb, lane);
#endif
        {{ACC_BODY}}
    }
    {{ACC_STORE}}
}

// Write the result for X row i, W row r (`u` is the up projection's under GATED); `scale` is
// the row's RMSNorm factor under NORM, else 1.
fn store(i: u32, r: u32, v: f32, u: f32, scale: f32) {
    if (r < p.rows) {
        let col = p.n_offset + r;
        let at = (p.x_row0 + i) * p.n_total + col;
        var s = v * scale;
#if BIAS
        s += bias[col];
#endif
#if RES
        s += res[at];
#endif
#if GATED
        s = glu(s, u * scale);
#endif
        y[at] = s;
    }
}
