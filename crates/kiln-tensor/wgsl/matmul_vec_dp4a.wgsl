// Y[i, n_offset + r] = sum_c X[i, c] * W[r, c] (+ bias) for a few rows i of X (decode), with
// W in Q8_0 or Q4_0 and X's rows as 8-bit blocks (`quantize_q8.wgsl`): each block's dot
// product is four `dot4I8Packed` a Q8_0 block's half, exact in i32, then scaled by both
// blocks' d (llama.cpp's route on GPUs with integer dot products). A workgroup of 64
// invocations holds 64 / TPR output rows; the TPR threads of a row take its blocks in turn
// and their sums meet in workgroup memory. `--kernels experimental` only.

struct Params {
    m: u32,
    k: u32,
    rows: u32,
    n_total: u32,
    n_offset: u32,
    qs: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> xq: array<u32>;
@group(0) @binding(2) var<storage, read> w: array<u32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
#if BIAS
@group(0) @binding(4) var<storage, read> bias: array<f32>;
#endif

const MV_M: u32 = {{MV_M}}u;
const TPR: u32 = {{TPR}}u;
const RPW: u32 = 64u / TPR;

var<workgroup> red: array<array<f32, MV_M>, 64>;

fn w_scale(b: u32) -> f32 {
    return unpack2x16float(w[b >> 1u])[b & 1u];
}

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let g = wid.x + wid.y * nwg.x;
    let r = g * RPW + lid / TPR;
    let lane = lid % TPR;
    let nb = p.k / 32u;
    var acc: array<f32, MV_M>;
    if (r < p.rows) {
        for (var b = lane; b < nb; b += TPR) {
            let wb = r * nb + b;
            let dw = w_scale(wb);
            var ww: array<u32, 8>;
#if W_Q8_0
            for (var j = 0u; j < 8u; j++) {
                ww[j] = w[p.qs + wb * 8u + j];
            }
#else
            // Q4_0: byte t of word j holds element 4j + t (low nibble) and 16 + 4j + t (high).
            for (var j = 0u; j < 4u; j++) {
                let q = w[p.qs + wb * 4u + j];
                ww[j] = q & 0x0f0f0f0fu;
                ww[j + 4u] = (q >> 4u) & 0x0f0f0f0fu;
            }
#endif
            for (var i = 0u; i < MV_M; i++) {
                let xb = (i * nb + b) * 10u;
                var s = 0i;
                for (var j = 0u; j < 8u; j++) {
                    s = dot4I8Packed(ww[j], xq[xb + j]) + s;
                }
#if W_Q4_0
                s -= 8i * bitcast<i32>(xq[xb + 9u]);
#endif
                acc[i] += dw * bitcast<f32>(xq[xb + 8u]) * f32(s);
            }
        }
    }
    red[lid] = acc;
    workgroupBarrier();
    let first = lid - lane;
    for (var i = lane; i < MV_M; i += TPR) {
        if (r < p.rows) {
            var s = 0.0;
            for (var l = 0u; l < TPR; l++) {
                s += red[first + l][i];
            }
            let col = p.n_offset + r;
#if BIAS
            s += bias[col];
#endif
            y[i * p.n_total + col] = s;
        }
    }
}
