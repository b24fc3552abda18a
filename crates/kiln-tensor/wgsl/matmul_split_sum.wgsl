// The tiled matmul's split-K partial products summed: Y[i, n_offset + r] = sum_s
// parts[s][i][r] (+ bias[n_offset + r]), one invocation an element of the chunk's columns.

struct Params {
    m: u32,
    rows: u32,
    n_total: u32,
    n_offset: u32,
    splits: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> parts: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
#if BIAS
@group(0) @binding(3) var<storage, read> bias: array<f32>;
#endif

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let e = (wid.x + wid.y * nwg.x) * 256u + lid;
    if (e >= p.m * p.rows) {
        return;
    }
    let i = e / p.rows;
    let r = e % p.rows;
    var s = 0.0;
    for (var j = 0u; j < p.splits; j++) {
        s += parts[j * p.m * p.rows + e];
    }
#if BIAS
    s += bias[p.n_offset + r];
#endif
    y[i * p.n_total + p.n_offset + r] = s;
}
