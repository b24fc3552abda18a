// Y[i, n_offset + r] = sum_c X[i, c] * W[r, c] (+ bias) for a few rows i of X (decode).
// A workgroup of 64 invocations holds 64 / TPR groups of RPL output rows; the TPR threads of a
// group split the row's length between them, eight elements at a time, and each thread
// computes all RPL rows of its group, so the X it loads serves RPL weight rows. Consecutive
// threads take consecutive eight-element units, so a warp's X reads (vec4 where k is a
// multiple of 8) and weight reads are contiguous. TPR is 8 on CPU-type adapters, whose
// compilers run a workgroup's invocations as SIMD lanes, and a warp or more on GPUs, so that
// enough loads are in flight to cover memory latency (see `MatvecShape`).
// What saves a launch each: NORM applies an RMSNorm to X's rows first (X·diag(g), each row's
// products scaled by 1/sqrt(mean(x²) + eps) at the end); RES adds a residual of Y's shape;
// GATED reads W as the stack [gate; up] of 2·n1 rows and writes act(X·gateᵀ) * (X·upᵀ)
// (glu.wgsl's activation). Y's row stride is n_total.
//
// ROUTED (mixture of experts, ggml's mul_mat_id): W holds n_exp experts of w_stride rows from
// expert e0, and the routing's groups (binding 4) list the slots routed to each (BIAS: each
// expert's bias, binding 5, added before the GLU, as GPT-OSS's experts have). A workgroup
// takes one tile of rows of one expert and runs through that expert's slots MV_M at a time:
// slot s reads row s / x_step of X and writes row s of Y. Each expert's weight is read by
// its workgroups once for all its slots (a pass per MV_M slots re-reads it from cache).

struct Params {
    m: u32,
    k: u32,
    rows: u32,
    n_total: u32,
    n_offset: u32,
    qs: u32,
    // GATED: the up rows start at row n1 of W (of the expert's rows under ROUTED).
    n1: u32,
    // NORM: the RMSNorm's epsilon.
    eps: f32,
    // ROUTED: workgroups an expert; the first expert of this binding and how many it holds;
    // slots a row of X; rows of W an expert; where the slot list starts in the groups.
    tiles: u32,
    e0: u32,
    n_exp: u32,
    x_step: u32,
    w_stride: u32,
    list: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
#if K8
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
#else
@group(0) @binding(1) var<storage, read> x: array<f32>;
#endif
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
#if BIAS
#if ROUTED
// [experts, w_stride]: each expert's bias ([gate; up] under GATED), after the groups (the
// binding NORM's weights take otherwise: a routed product is never normed).
@group(0) @binding(5) var<storage, read> bias: array<f32>;
#else
@group(0) @binding(4) var<storage, read> bias: array<f32>;
#endif
#endif
#if RES
@group(0) @binding(4) var<storage, read> res: array<f32>;
#endif
#if NORM
@group(0) @binding({{G_BINDING}}) var<storage, read> gw: array<f32>;
#endif
#if ROUTED
@group(0) @binding(4) var<storage, read> groups: array<u32>;
// This pass's rows of X and of Y (as element offsets), by slot of the pass.
var<private> x_base: array<u32, {{MV_M}}>;
var<private> y_base: array<u32, {{MV_M}}>;
var<workgroup> span: vec2<u32>;
// Where the workgroup's expert's bias starts.
var<private> b_base: u32;
#endif

const MV_M: u32 = {{MV_M}}u;
const TPR: u32 = {{TPR}}u;
const RPL: u32 = {{RPL}}u;
const RPW: u32 = 64u / TPR;
// Accumulators a thread holds: row i of X times row t of its group at i * RPL + t.
const NACC: u32 = MV_M * RPL;

var<workgroup> red: array<array<f32, NACC>, 64>;
#if GATED
var<workgroup> red2: array<array<f32, NACC>, 64>;
#endif
#if NORM
var<workgroup> red_ss: array<array<f32, MV_M>, 64>;
#endif

// Where row i of this pass starts in X and in Y.
fn x_at(i: u32) -> u32 {
#if ROUTED
    return x_base[i];
#else
    return i * p.k;
#endif
}
fn y_at(i: u32) -> u32 {
#if ROUTED
    return y_base[i];
#else
    return i * p.n_total;
#endif
}

fn x4(i: u32, c: u32) -> vec4<f32> {
#if K8
    return x[(x_at(i) + c) / 4u];
#else
    var v = vec4<f32>(0.0);
    for (var j = 0u; j < 4u; j++) {
        if (c + j < p.k) {
            v[j] = x[x_at(i) + c + j];
        }
    }
    return v;
#endif
}

#if NORM
// The norm's weights at columns c..c + 4 (zeros past k).
fn g4(c: u32) -> vec4<f32> {
#if K8
    return vec4<f32>(gw[c], gw[c + 1u], gw[c + 2u], gw[c + 3u]);
#else
    var v = vec4<f32>(0.0);
    for (var j = 0u; j < 4u; j++) {
        if (c + j < p.k) {
            v[j] = gw[c + j];
        }
    }
    return v;
#endif
}
#endif

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let g = wid.x + wid.y * nwg.x;
#if ROUTED
    let el = g / p.tiles;
    if (lid == 0u) {
        if (el < p.n_exp) {
            span = vec2<u32>(groups[p.e0 + el], groups[p.e0 + el + 1u]);
        } else {
            span = vec2<u32>(0u, 0u);
        }
    }
    let s = workgroupUniformLoad(&span);
    b_base = (p.e0 + el) * p.w_stride;
    for (var s0 = s.x; s0 < s.y; s0 += MV_M) {
        for (var i = 0u; i < MV_M; i++) {
            // Past the expert's last slot, the last one again: computed, not stored.
            let slot = groups[p.list + min(s0 + i, s.y - 1u)];
            x_base[i] = slot / p.x_step * p.k;
            y_base[i] = slot * p.n_total;
        }
        product(g % p.tiles, lid, el * p.w_stride, min(MV_M, s.y - s0));
        workgroupBarrier();
    }
#else
    product(g, lid, 0u, MV_M);
#endif
}

// The tile g of output rows for the rows of X this pass holds (the first `valid` stored),
// from W's rows w0 on.
fn product(g: u32, lid: u32, w0: u32, valid: u32) {
    let r0 = (g * RPW + lid / TPR) * RPL;
    let lane = lid % TPR;
    var acc: array<f32, NACC>;
#if GATED
    var acc2: array<f32, NACC>;
#endif
#if NORM
    var ss: array<f32, MV_M>;
#endif
    if (r0 < p.rows) {
        let units = (p.k + 7u) / 8u;
        for (var u = lane; u < units; u += TPR) {
            var xa: array<vec4<f32>, MV_M>;
            var xb: array<vec4<f32>, MV_M>;
#if NORM
            let ga = g4(u * 8u);
            let gb = g4(u * 8u + 4u);
#endif
            for (var i = 0u; i < MV_M; i++) {
                xa[i] = x4(i, u * 8u);
                xb[i] = x4(i, u * 8u + 4u);
#if NORM
                ss[i] += dot(xa[i], xa[i]) + dot(xb[i], xb[i]);
                xa[i] *= ga;
                xb[i] *= gb;
#endif
            }
            for (var t = 0u; t < RPL; t++) {
                // Rows past the end repeat the last one; their sums are not stored.
                let r = w0 + min(r0 + t, p.rows - 1u);
                let wv = w_unit8(r, u, p.k, p.qs);
#if GATED
                let wu = w_unit8(r + p.n1, u, p.k, p.qs);
#endif
                for (var i = 0u; i < MV_M; i++) {
                    acc[i * RPL + t] += dot(wv.a, xa[i]) + dot(wv.b, xb[i]);
#if GATED
                    acc2[i * RPL + t] += dot(wu.a, xa[i]) + dot(wu.b, xb[i]);
#endif
                }
            }
        }
    }
    red[lid] = acc;
#if GATED
    red2[lid] = acc2;
#endif
#if NORM
    red_ss[lid] = ss;
#endif
    workgroupBarrier();
    // Thread j of a group sums accumulator j over the group's TPR threads.
    let first = lid - lane;
    for (var j = lane; j < NACC; j += TPR) {
        let i = j / RPL;
        let r = r0 + j % RPL;
        if (r < p.rows && i < valid) {
            let col = p.n_offset + r;
            var s = 0.0;
#if GATED
            var s2 = 0.0;
#endif
#if NORM
            var sq = 0.0;
#endif
            for (var l = 0u; l < TPR; l++) {
                s += red[first + l][j];
#if GATED
                s2 += red2[first + l][j];
#endif
#if NORM
                sq += red_ss[first + l][i];
#endif
            }
#if NORM
            let scale = inverseSqrt(sq / f32(p.k) + p.eps);
            s *= scale;
#if GATED
            s2 *= scale;
#endif
#endif
#if BIAS
#if ROUTED
            s += bias[b_base + col];
#if GATED
            s2 += bias[b_base + p.n1 + col];
#endif
#else
            s += bias[col];
#endif
#endif
#if RES
            s += res[y_at(i) + col];
#endif
#if GATED
            s = glu(s, s2);
#endif
            y[y_at(i) + col] = s;
        }
    }
}
