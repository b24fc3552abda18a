// Y[x_row0 + i, n_offset + r] = sum_c X[i, c] * W[r, c] (+ bias) for CPU-type adapters
// (lavapipe, SwiftShader): compilers there run invocations as SIMD lanes and turn every
// storage read into a per-lane loop, so this kernel gives each invocation R whole rows of W
// (one 16-byte read per block of quants) and reads X from a uniform binding at
// workgroup-uniform offsets, which becomes one broadcast load. MV_M rows of X a launch; the
// caller binds the rows this launch covers. W is a block format (Q8_0, Q4_0, Q4_1) in the
// device layout of quant.rs, its quants 16-byte aligned.
//
// Epilogues that save a launch each: RES adds a residual of Y's shape (Y = RES + X·Wᵀ);
// GATED takes a second weight W2 of W's shape and dtype and writes act(X·Wᵀ) * (X·W2ᵀ)
// (the gate and up projections of a gated MLP; act is silu, or GELU-tanh under GELU); QKV
// computes the Q, K and V projections (weights W, W2, W3 of n1, n2 and n2 rows, one dtype)
// into Y, Y2 and Y3, its rows numbered through all three.

struct Params {
    m: u32,
    k: u32,
    rows: u32,
    n_total: u32,
    n_offset: u32,
    qs: u32,
    x_row0: u32,
    // Quants offsets of W2 and W3, and the QKV row split.
    qs2: u32,
    qs3: u32,
    n1: u32,
    n2: u32,
    _pad: u32,
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
#if GATED
@group(0) @binding(4) var<storage, read> wq2: array<vec4<u32>>;
#endif
#if QKV
@group(0) @binding(4) var<storage, read> wq2: array<vec4<u32>>;
@group(0) @binding(5) var<storage, read> wq3: array<vec4<u32>>;
@group(0) @binding(6) var<storage, read_write> y2: array<f32>;
@group(0) @binding(7) var<storage, read_write> y3: array<f32>;
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

fn i8x4(x: u32) -> vec4<f32> {
    return vec4<f32>(bitcast<vec4<i32>>(vec4<u32>(x << 24u, x << 16u, x << 8u, x)) >> vec4<u32>(24u));
}

#if W_Q8_0
const QV: u32 = 2u;
#else
const QV: u32 = 1u;
#endif

// Block b from its scale word and its quants (v1 is used by Q8_0 only).
fn decode(b: u32, sw: u32, v0: vec4<u32>, v1: vec4<u32>) -> Blk {
#if W_Q4_1
    let dm = unpack2x16float(sw);
    let d = dm.x;
    let m = dm.y;
#endif
#if W_Q4_0
    let d = unpack2x16float(sw)[b & 1u];
    let m = -8.0 * d;
#endif
#if W_Q8_0
    let d = unpack2x16float(sw)[b & 1u];
    return Blk(i8x4(v0.x) * d, i8x4(v0.y) * d, i8x4(v0.z) * d, i8x4(v0.w) * d,
        i8x4(v1.x) * d, i8x4(v1.y) * d, i8x4(v1.z) * d, i8x4(v1.w) * d);
#else
    let hi = v0 >> vec4<u32>(4u);
    return Blk(nib4(v0.x) * d + m, nib4(v0.y) * d + m, nib4(v0.z) * d + m, nib4(v0.w) * d + m,
        nib4(hi.x) * d + m, nib4(hi.y) * d + m, nib4(hi.z) * d + m, nib4(hi.w) * d + m);
#endif
}

// Word index of block b's scale word (the scales are the leading words of the buffer; Q4_1
// has one d|m word a block, the others one f16 a block).
fn scale_index(b: u32) -> u32 {
#if W_Q4_1
    return b;
#else
    return b >> 1u;
#endif
}

fn load_blk(b: u32) -> Blk {
    let si = scale_index(b);
    let qi = (p.qs >> 2u) + b * QV;
    let v0 = wq[qi];
#if W_Q8_0
    let v1 = wq[qi + 1u];
#else
    let v1 = v0;
#endif
    return decode(b, wq[si >> 2u][si & 3u], v0, v1);
}

#if W2
fn load_blk2(b: u32) -> Blk {
    let si = scale_index(b);
    let qi = (p.qs2 >> 2u) + b * QV;
    let v0 = wq2[qi];
#if W_Q8_0
    let v1 = wq2[qi + 1u];
#else
    let v1 = v0;
#endif
    return decode(b, wq2[si >> 2u][si & 3u], v0, v1);
}
#endif

#if QKV
fn load_blk3(b: u32) -> Blk {
    let si = scale_index(b);
    let qi = (p.qs3 >> 2u) + b * QV;
    let v0 = wq3[qi];
#if W_Q8_0
    let v1 = wq3[qi + 1u];
#else
    let v1 = v0;
#endif
    return decode(b, wq3[si >> 2u][si & 3u], v0, v1);
}

// Block `blk` of row r of the stacked [W; W2; W3].
fn load_row(r: u32, blk: u32, nb: u32) -> Blk {
    if (r < p.n1) {
        return load_blk(r * nb + blk);
    }
    if (r < p.n1 + p.n2) {
        return load_blk2((r - p.n1) * nb + blk);
    }
    return load_blk3((r - p.n1 - p.n2) * nb + blk);
}
#else
fn load_row(r: u32, blk: u32, nb: u32) -> Blk {
    return load_blk(r * nb + blk);
}
#endif

// The 32 values of X at vec4 index xb. With SG_X (subgroups of at least 8 lanes), lane j
// reads vec4 j & 7 and the others take it by broadcast: one gather a block instead of eight,
// which is what these compilers make of a uniform-buffer read at a loop-dependent offset.
#if SG_X
fn xblk(xb: u32, lane: u32) -> Blk {
    let v = xu[xb + (lane & 7u)];
    return Blk(subgroupBroadcast(v, 0u), subgroupBroadcast(v, 1u), subgroupBroadcast(v, 2u),
        subgroupBroadcast(v, 3u), subgroupBroadcast(v, 4u), subgroupBroadcast(v, 5u),
        subgroupBroadcast(v, 6u), subgroupBroadcast(v, 7u));
}
#else
fn xblk(xb: u32, lane: u32) -> Blk {
    return Blk(xu[xb], xu[xb + 1u], xu[xb + 2u], xu[xb + 3u], xu[xb + 4u], xu[xb + 5u],
        xu[xb + 6u], xu[xb + 7u]);
}
#endif

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
        {{ACC_BODY}}
    }
    {{ACC_STORE}}
}

// GELU with the tanh approximation; the tanh argument is clamped to ±15 (where f32 tanh is
// already ±1) because some drivers compute tanh through exp and return NaN beyond.
fn gelu_tanh(g: f32) -> f32 {
    let t = clamp(0.7978845608028654 * (g + 0.044715 * g * g * g), -15.0, 15.0);
    return 0.5 * g * (1.0 + tanh(t));
}

// Write the result for X row i, W row r (`u` is the up projection's under GATED).
fn store(i: u32, r: u32, v: f32, u: f32) {
    if (r < p.rows) {
        let col = p.n_offset + r;
        let at = (p.x_row0 + i) * p.n_total + col;
        var s = v;
#if BIAS
        s += bias[col];
#endif
#if RES
        s += res[at];
#endif
#if GATED
#if GELU
        s = gelu_tanh(s) * u;
#else
        s = s / (1.0 + exp(-s)) * u;
#endif
#endif
#if QKV
        let row = p.x_row0 + i;
        if (r < p.n1) {
            y[row * p.n1 + r] = s;
        } else if (r < p.n1 + p.n2) {
            y2[row * p.n2 + r - p.n1] = s;
        } else {
            y3[row * p.n2 + r - p.n1 - p.n2] = s;
        }
#else
        y[at] = s;
#endif
    }
}
