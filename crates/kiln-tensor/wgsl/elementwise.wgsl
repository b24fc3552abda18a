// Elementwise ops over n f32 values.
// Binary (a, b):
// ADD:           out = a + b
// SILU_MUL:      out = silu(a) * b = a / (1 + exp(-a)) * b   (SwiGLU with a = gate, b = up)
// GELU_TANH_MUL: out = gelu_tanh(a) * b                      (GeGLU with a = gate, b = up)
// Unary (UNARY, a only; `s` is the op's scalar):
// SCALE:         out = a * s
// SOFTCAP:       out = s * tanh(a / s)
// GLU:           a is rows of [gate | up], each `cols` wide; out[row, j] = act(gate) * up,
//                act = silu, or GELU-tanh under GELU (n counts the outputs)

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

// tanh of an argument clamped to ±15, where f32 tanh is already ±1: some drivers compute tanh
// through exp and return NaN for large arguments.
fn tanh_safe(t: f32) -> f32 {
    return tanh(clamp(t, -15.0, 15.0));
}

// GELU, tanh approximation (`gelu_pytorch_tanh`).
fn gelu_tanh(g: f32) -> f32 {
    return 0.5 * g * (1.0 + tanh_safe(0.7978845608028654 * (g + 0.044715 * g * g * g)));
}

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
#if GELU
    out[i] = gelu_tanh(g) * u;
#else
    out[i] = g / (1.0 + exp(-g)) * u;
#endif
#endif
}
