// Row-wise ops, one 64-thread workgroup per row of a [rows, cols] tensor:
// RMS_NORM: out = x / sqrt(mean(x²) + eps) * weight
// SOFTMAX:  out = exp(x - max) / sum(exp(x - max))
// ARGMAX:   out[row] = index of the largest value (the first one on ties)

struct Params {
    rows: u32,
    cols: u32,
    eps: f32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
#if RMS_NORM
@group(0) @binding(2) var<storage, read> weight: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
#endif
#if SOFTMAX
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
#endif
#if ARGMAX
@group(0) @binding(2) var<storage, read_write> out: array<u32>;
#endif

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    {{SG_ARG}}
) {
    let row = wid.x + wid.y * nwg.x;
    // Uniform per workgroup, so the barriers in the reductions stay in uniform control flow.
    if (row >= p.rows) {
        return;
    }
    let base = row * p.cols;
#if RMS_NORM
    var ss = 0.0;
    for (var c = lid; c < p.cols; c += 64u) {
        let v = x[base + c];
        ss += v * v;
    }
    let total = wg_sum(ss, lid, {{SG_LANE}});
    let scale = inverseSqrt(total / f32(p.cols) + p.eps);
    for (var c = lid; c < p.cols; c += 64u) {
        out[base + c] = x[base + c] * scale * weight[c];
    }
#endif
#if SOFTMAX
    var mx = bitcast<f32>(0xff800000u);
    for (var c = lid; c < p.cols; c += 64u) {
        mx = max(mx, x[base + c]);
    }
    let m = wg_max(mx, lid, {{SG_LANE}});
    var s = 0.0;
    for (var c = lid; c < p.cols; c += 64u) {
        s += exp(x[base + c] - m);
    }
    let total = wg_sum(s, lid, {{SG_LANE}});
    for (var c = lid; c < p.cols; c += 64u) {
        out[base + c] = exp(x[base + c] - m) / total;
    }
#endif
#if ARGMAX
    var bv = bitcast<f32>(0xff800000u);
    var bi = 0xffffffffu;
    for (var c = lid; c < p.cols; c += 64u) {
        let v = x[base + c];
        if (v > bv || bi == 0xffffffffu) {
            bv = v;
            bi = c;
        }
    }
    let best = wg_argmax(bv, bi, lid, {{SG_LANE}});
    if (lid == 0u) {
        out[row] = best;
    }
#endif
}
