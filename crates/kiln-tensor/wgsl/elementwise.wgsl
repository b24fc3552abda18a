// Elementwise ops over n f32 values.
// Binary (a, b):
// ADD:           out = a + b
// SILU_MUL:      out = silu(a) * b = a / (1 + exp(-a)) * b   (SwiGLU with a = gate, b = up)
// GELU_TANH_MUL: out = gelu_tanh(a) * b                      (GeGLU with a = gate, b = up)
// Unary (UNARY, a only; `s` is the op's scalar):
// SCALE:         out = a * s
// SOFTCAP:       out = s * tanh(a / s)
// GLU:           a is rows of [gate | up], each `cols` wide; out[row, j] = glu(gate, up),
//                glu.wgsl's activation (n counts the outputs)
// GLU_MUL:       out = glu(a, b), a the gate, b the up projection
// CONCAT:        out = a's `cols` values (its count), then b's

struct Params {
    n: u32,
    s: f32,
    cols: u32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
#if UNARY
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
#else
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
#endif

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
#if GELU_TANH_MUL
    out[i] = gelu_tanh(a[i]) * b[i];
#endif
#if SCALE
    out[i] = a[i] * p.s;
#endif
#if SOFTCAP
    out[i] = p.s * tanh_safe(a[i] / p.s);
#endif
#if GLU
    let g = a[(i / p.cols) * 2u * p.cols + i % p.cols];
    let u = a[(i / p.cols) * 2u * p.cols + p.cols + i % p.cols];
    out[i] = glu(g, u);
#endif
#if GLU_MUL
    out[i] = glu(a[i], b[i]);
#endif
#if CONCAT
    if (i < p.cols) {
        out[i] = a[i];
    } else {
        out[i] = b[i - p.cols];
    }
#endif
}
