// Y[i, n_offset + r] = sum_c X[i, c] * W[r, c] (+ bias), tiled for many rows of X (prefill).
// A workgroup computes a 32 x 32 tile of Y; each of its 64 threads a 4 x 4 block. W is
// dequantized into workgroup memory one 32-wide slice of k at a time.

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

const T: u32 = 32u;

var<workgroup> xs: array<array<f32, 33>, 32>;
var<workgroup> ws: array<array<f32, 33>, 32>;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let g = wid.x + wid.y * nwg.x;
    let tiles_n = (p.rows + T - 1u) / T;
    let tm = g / tiles_n;
    let tn = g % tiles_n;
    if (tm * T >= p.m) {
        return;
    }
    let ty = lid / 8u;
    let tx = lid % 8u;
    // The 4 x 4 block lives in four vec4 registers: no dynamically indexed arrays, which
    // compilers for CPU-type adapters would spill to memory.
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    for (var k0 = 0u; k0 < p.k; k0 += T) {
        for (var e = lid; e < T * T; e += 64u) {
            let r = e / T;
            let c = e % T;
            let gr = tm * T + r;
            let gc = k0 + c;
            var v = 0.0;
            if (gr < p.m && gc < p.k) {
                v = x[gr * p.k + gc];
            }
            xs[r][c] = v;
            let wr = tn * T + r;
            var wv = 0.0;
            if (wr < p.rows && gc < p.k) {
                wv = w_at(wr, gc, p.k, p.qs);
            }
            ws[r][c] = wv;
        }
        workgroupBarrier();
        let xr = ty * 4u;
        let wr = tx * 4u;
        for (var kk = 0u; kk < T; kk++) {
            let b = vec4<f32>(ws[wr][kk], ws[wr + 1u][kk], ws[wr + 2u][kk], ws[wr + 3u][kk]);
            acc0 += xs[xr][kk] * b;
            acc1 += xs[xr + 1u][kk] * b;
            acc2 += xs[xr + 2u][kk] * b;
            acc3 += xs[xr + 3u][kk] * b;
        }
        workgroupBarrier();
    }
    let accs = array<vec4<f32>, 4>(acc0, acc1, acc2, acc3);
    for (var i = 0u; i < 4u; i++) {
        let gm = tm * T + ty * 4u + i;
        let row = accs[i];
        for (var j = 0u; j < 4u; j++) {
            let gn = tn * T + tx * 4u + j;
            if (gm < p.m && gn < p.rows) {
                var s = row[j];
#if BIAS
                s += bias[p.n_offset + gn];
#endif
                y[gm * p.n_total + p.n_offset + gn] = s;
            }
        }
    }
}
