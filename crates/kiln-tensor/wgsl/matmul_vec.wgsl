// Y[i, n_offset + r] = sum_c X[i, c] * W[r, c] (+ bias) for a few rows i of X (decode).
// Eight threads share one output row r; each walks the row eight elements at a time.

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
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
#if BIAS
@group(0) @binding(4) var<storage, read> bias: array<f32>;
#endif

const MV_M: u32 = {{MV_M}}u;
const TPR: u32 = 8u;
const RPW: u32 = 8u;

var<workgroup> red: array<array<f32, MV_M>, 64>;

fn x4(i: u32, c: u32) -> vec4<f32> {
#if K8
    let b = i * p.k + c;
    return vec4<f32>(x[b], x[b + 1u], x[b + 2u], x[b + 3u]);
#else
    var v = vec4<f32>(0.0);
    for (var j = 0u; j < 4u; j++) {
        if (c + j < p.k) {
            v[j] = x[i * p.k + c + j];
        }
    }
    return v;
#endif
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
    var acc: array<f32, MV_M>;
    if (r < p.rows) {
        let units = (p.k + 7u) / 8u;
        for (var u = lane; u < units; u += TPR) {
            let wv = w_unit8(r, u, p.k, p.qs);
            for (var i = 0u; i < MV_M; i++) {
                acc[i] += dot(wv.a, x4(i, u * 8u)) + dot(wv.b, x4(i, u * 8u + 4u));
            }
        }
    }
    red[lid] = acc;
    workgroupBarrier();
    if (lane == 0u && r < p.rows) {
        let col = p.n_offset + r;
        for (var i = 0u; i < MV_M; i++) {
            var s = 0.0;
            for (var j = 0u; j < TPR; j++) {
                s += red[lid + j][i];
            }
#if BIAS
            s += bias[col];
#endif
            y[i * p.n_total + col] = s;
        }
    }
}
