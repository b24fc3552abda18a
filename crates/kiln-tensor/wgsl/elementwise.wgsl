// Elementwise binary ops over n f32 values:
// ADD:      out = a + b
// SILU_MUL: out = silu(a) * b = a / (1 + exp(-a)) * b   (SwiGLU with a = gate, b = up)

struct Params {
    n: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let i = (wid.x + wid.y * nwg.x) * 64u + lid;
    if (i >= p.n) {
        return;
    }
#if ADD
    out[i] = a[i] + b[i];
#endif
#if SILU_MUL
    let g = a[i];
    out[i] = g / (1.0 + exp(-g)) * b[i];
#endif
}
