// X's rows in blocks of 32 as 8-bit integers for the integer dot product kernels
// (`matmul_vec_dp4a.wgsl`), one invocation a block: d = max|x| / 127, q = round(x / d), stored
// as ten words a block: the 32 values four to a word (element 4j + t in byte t of word j),
// then d (f32 bits), then the sum of the 32 values (i32; Q4_0's offset of 8 needs it).

struct Params {
    rows: u32,
    k: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> xq: array<u32>;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let nb = p.k / 32u;
    let g = (wid.x + wid.y * nwg.x) * 64u + lid;
    if (g >= p.rows * nb) {
        return;
    }
    let row = g / nb;
    let base = row * p.k + (g % nb) * 32u;
    var amax = 0.0;
    for (var j = 0u; j < 32u; j++) {
        amax = max(amax, abs(x[base + j]));
    }
    let d = amax / 127.0;
    var inv = 0.0;
    if (d > 0.0) {
        inv = 1.0 / d;
    }
    var sum = 0i;
    for (var j = 0u; j < 8u; j++) {
        let v = vec4<f32>(x[base + 4u * j], x[base + 4u * j + 1u], x[base + 4u * j + 2u], x[base + 4u * j + 3u]);
        let q = vec4<i32>(clamp(round(v * inv), vec4<f32>(-127.0), vec4<f32>(127.0)));
        sum += q.x + q.y + q.z + q.w;
        xq[g * 10u + j] = pack4xI8(q);
    }
    xq[g * 10u + 8u] = bitcast<u32>(d);
    xq[g * 10u + 9u] = bitcast<u32>(sum);
}
