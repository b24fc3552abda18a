// Weight loaders shared by matmul and embedding. A weight chunk is [rows, k] in one of the
// dtypes below; `qs` is the word offset of the quants for the block formats (their scales come
// first, see quant.rs). The including kernel sets W_BINDING and one of the W_* switches.

struct W8 {
    a: vec4<f32>,
    b: vec4<f32>,
}

#if W_F32
@group(0) @binding({{W_BINDING}}) var<storage, read> w: array<f32>;
fn w_at(row: u32, col: u32, k: u32, qs: u32) -> f32 {
    return w[row * k + col];
}
#endif

#if W_F16
#if F16
@group(0) @binding({{W_BINDING}}) var<storage, read> w: array<f16>;
fn w_at(row: u32, col: u32, k: u32, qs: u32) -> f32 {
    return f32(w[row * k + col]);
}
#else
@group(0) @binding({{W_BINDING}}) var<storage, read> w: array<u32>;
fn w_at(row: u32, col: u32, k: u32, qs: u32) -> f32 {
    let i = row * k + col;
    return unpack2x16float(w[i >> 1u])[i & 1u];
}
#endif
#endif

#if W_FLOAT
// Eight consecutive elements starting at column 8u; zeros past the end of the row.
fn w_unit8(row: u32, u: u32, k: u32, qs: u32) -> W8 {
    var v: array<f32, 8>;
    for (var j = 0u; j < 8u; j++) {
        let c = u * 8u + j;
        if (c < k) {
            v[j] = w_at(row, c, k, qs);
        }
    }
    return W8(vec4<f32>(v[0], v[1], v[2], v[3]), vec4<f32>(v[4], v[5], v[6], v[7]));
}
#endif

#if W_QUANT
@group(0) @binding({{W_BINDING}}) var<storage, read> w: array<u32>;

// Four nibbles at bit offsets 0, 8, 16, 24 of x.
fn nib4(x: u32) -> vec4<f32> {
    return vec4<f32>(vec4<u32>(x, x >> 8u, x >> 16u, x >> 24u) & vec4<u32>(0xfu));
}
#endif

#if W_Q8_0
fn w_scale(b: u32) -> f32 {
    return unpack2x16float(w[b >> 1u])[b & 1u];
}
fn i8x4(x: u32) -> vec4<f32> {
    let v = bitcast<vec4<i32>>(vec4<u32>(x << 24u, x << 16u, x << 8u, x)) >> vec4<u32>(24u);
    return vec4<f32>(v);
}
fn w_at(row: u32, col: u32, k: u32, qs: u32) -> f32 {
    let b = row * (k / 32u) + col / 32u;
    let i = col % 32u;
    let word = w[qs + b * 8u + i / 4u];
    let q = bitcast<i32>(word << (24u - 8u * (i % 4u))) >> 24u;
    return f32(q) * w_scale(b);
}
fn w_unit8(row: u32, u: u32, k: u32, qs: u32) -> W8 {
    let b = row * (k / 32u) + u / 4u;
    let base = qs + b * 8u + (u % 4u) * 2u;
    let d = w_scale(b);
    return W8(i8x4(w[base]) * d, i8x4(w[base + 1u]) * d);
}
#endif

#if W_Q4_0
fn w_scale(b: u32) -> f32 {
    return unpack2x16float(w[b >> 1u])[b & 1u];
}
fn w_at(row: u32, col: u32, k: u32, qs: u32) -> f32 {
    let b = row * (k / 32u) + col / 32u;
    let i = col % 32u;
    let byte_i = i % 16u;
    let word = w[qs + b * 4u + byte_i / 4u];
    let q = (word >> (8u * (byte_i % 4u) + 4u * (i / 16u))) & 0xfu;
    return (f32(q) - 8.0) * w_scale(b);
}
fn w_unit8(row: u32, u: u32, k: u32, qs: u32) -> W8 {
    let b = row * (k / 32u) + u / 4u;
    let p = u % 4u;
    let base = qs + b * 4u + (p % 2u) * 2u;
    let sh = (p / 2u) * 4u;
    let d = w_scale(b);
    return W8((nib4(w[base] >> sh) - 8.0) * d, (nib4(w[base + 1u] >> sh) - 8.0) * d);
}
#endif

#if W_Q4_1
fn w_at(row: u32, col: u32, k: u32, qs: u32) -> f32 {
    let b = row * (k / 32u) + col / 32u;
    let i = col % 32u;
    let byte_i = i % 16u;
    let word = w[qs + b * 4u + byte_i / 4u];
    let q = (word >> (8u * (byte_i % 4u) + 4u * (i / 16u))) & 0xfu;
    let dm = unpack2x16float(w[b]);
    return f32(q) * dm.x + dm.y;
}
fn w_unit8(row: u32, u: u32, k: u32, qs: u32) -> W8 {
    let b = row * (k / 32u) + u / 4u;
    let p = u % 4u;
    let base = qs + b * 4u + (p % 2u) * 2u;
    let sh = (p / 2u) * 4u;
    let dm = unpack2x16float(w[b]);
    return W8(nib4(w[base] >> sh) * dm.x + dm.y, nib4(w[base + 1u] >> sh) * dm.x + dm.y);
}
#endif
