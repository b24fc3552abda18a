// Weight loaders shared by matmul and embedding. A weight chunk is [rows, k] in one of the
// dtypes below; `qs` is the word offset of the quants for the block formats (their scales come
// first, see quant/layout.rs). The including kernel sets W_BINDING and one of the W_* switches.

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

#if W_BF16
@group(0) @binding({{W_BINDING}}) var<storage, read> w: array<u32>;
// bf16 is the top half of an f32.
fn w_at(row: u32, col: u32, k: u32, qs: u32) -> f32 {
    let i = row * k + col;
    return bitcast<f32>(((w[i >> 1u] >> (16u * (i & 1u))) & 0xffffu) << 16u);
}
#endif

#if W_SUB
// The 5-bit formats, the K-quants and kiln's zero-point formats, decoded four elements at a
// time from the regrouped device layout of quant/layout.rs. `b` numbers 32-element sub-blocks
// through the chunk (super-block b / 8, sub-block b % 8 of it for the K-quants), `c` (0..8)
// picks elements 4c..4c+3 of the sub-block: nibble word c % 4 (high nibbles for c >= 4),
// 2-bit word c / 4 at bit 2 (c % 4), high bits 4c..4c+3, byte word c.
fn two4(x: u32) -> vec4<f32> {
    return vec4<f32>(vec4<u32>(x, x >> 8u, x >> 16u, x >> 24u) & vec4<u32>(3u));
}
fn bit4(x: u32) -> vec4<f32> {
    return vec4<f32>(vec4<u32>(x, x >> 1u, x >> 2u, x >> 3u) & vec4<u32>(1u));
}
// Elements 4c..4c+3 of the 16 nibble bytes from word `at` on.
fn nibs(at: u32, c: u32) -> vec4<f32> {
    return nib4(w[at + c % 4u] >> (4u * (c / 4u)));
}
// Byte j of the words from `at` on.
fn byte_at(at: u32, j: u32) -> u32 {
    return (w[at + j / 4u] >> (8u * (j % 4u))) & 0xffu;
}

fn w_at(row: u32, col: u32, k: u32, qs: u32) -> f32 {
    let i = col % 32u;
    return q4v(row * (k / 32u) + col / 32u, i / 4u, qs)[i % 4u];
}
fn w_unit8(row: u32, u: u32, k: u32, qs: u32) -> W8 {
    let b = row * (k / 32u) + u / 4u;
    let c = (u % 4u) * 2u;
    return W8(q4v(b, c, qs), q4v(b, c + 1u, qs));
}
#endif

#if W_MXFP4
// E2M1 values doubled, by nibble; the scale is half the E8M0 exponent's power of two, the
// exponent the low byte of its block's half of a head word.
var<private> MX: array<f32, 16> = array<f32, 16>(
    0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -12.0);
fn q4v(b: u32, c: u32, qs: u32) -> vec4<f32> {
    let e = (w[b >> 1u] >> (16u * (b & 1u))) & 0xffu;
    var d = bitcast<f32>((e - 1u) << 23u);
    if (e < 2u) {
        d = bitcast<f32>(0x00200000u << e);
    }
    let x = w[qs + b * 4u + c % 4u] >> (4u * (c / 4u));
    return d * vec4<f32>(MX[x & 0xfu], MX[(x >> 8u) & 0xfu], MX[(x >> 16u) & 0xfu], MX[(x >> 24u) & 0xfu]);
}
#endif

#if W_FP8
// OCP E4M3 codes (sign, 4 exponent bits of bias 7, 3 mantissa bits; m·2^-9 at exponent 0)
// under the f32 scale of the block's head word; exact, as the CPU reference decodes them.
fn e4m3(q: u32) -> f32 {
    let e = (q >> 3u) & 0xfu;
    var v = bitcast<f32>(((e + 120u) << 23u) | ((q & 7u) << 20u));
    if (e == 0u) {
        v = f32(q & 7u) * 0.001953125;
    }
    return select(v, -v, (q & 0x80u) != 0u);
}
fn q4v(b: u32, c: u32, qs: u32) -> vec4<f32> {
    let d = bitcast<f32>(w[b]);
    let x = w[qs + b * 8u + c];
    return vec4<f32>(e4m3(x & 0xffu), e4m3((x >> 8u) & 0xffu), e4m3((x >> 16u) & 0xffu), e4m3(x >> 24u)) * d;
}
#endif

#if W_Q5_0
fn q4v(b: u32, c: u32, qs: u32) -> vec4<f32> {
    let d = unpack2x16float(w[2u * b]).x;
    let q = nibs(qs + b * 4u, c) + 16.0 * bit4(w[2u * b + 1u] >> (4u * c));
    return d * (q - 16.0);
}
#endif

#if W_Q5_1
fn q4v(b: u32, c: u32, qs: u32) -> vec4<f32> {
    let dm = unpack2x16float(w[2u * b]);
    let q = nibs(qs + b * 4u, c) + 16.0 * bit4(w[2u * b + 1u] >> (4u * c));
    return dm.x * q + dm.y;
}
#endif

#if W_Q2_K
fn q4v(b: u32, c: u32, qs: u32) -> vec4<f32> {
    let sb = b / 8u;
    let s = b % 8u;
    let dm = unpack2x16float(w[sb]);
    let base = qs + sb * 20u;
    let sc = byte_at(base, 2u * s + c / 4u);
    let dl = dm.x * f32(sc & 0xfu);
    let ml = dm.y * f32(sc >> 4u);
    return dl * two4(w[base + 4u + 2u * s + c / 4u] >> (2u * (c % 4u))) - ml;
}
#endif

#if W_Q3_K
fn q4v(b: u32, c: u32, qs: u32) -> vec4<f32> {
    let sb = b / 8u;
    let s = b % 8u;
    let h = 4u * sb;
    let d = unpack2x16float(w[h + 3u]).x;
    let i = 2u * s + c / 4u;
    let low = (byte_at(h, i % 8u) >> (4u * (i / 8u))) & 0xfu;
    let high = (byte_at(h, 8u + i % 4u) >> (2u * (i / 4u))) & 3u;
    let dl = d * f32(i32(low | (high << 4u)) - 32);
    let base = qs + sb * 24u;
    let lo = two4(w[base + 8u + 2u * s + c / 4u] >> (2u * (c % 4u)));
    // A clear high bit subtracts 4.
    let hi = bit4(w[base + s] >> (4u * c));
    return dl * (lo - 4.0 * (1.0 - hi));
}
#endif

#if W_Q45_K
// Scale and min j (0..8) of the 12 packed bytes at word `at`.
fn scale_min(at: u32, j: u32) -> vec2<f32> {
    if (j < 4u) {
        return vec2<f32>(f32(byte_at(at, j) & 63u), f32(byte_at(at, j + 4u) & 63u));
    }
    let sc = (byte_at(at, j + 4u) & 0xfu) | ((byte_at(at, j - 4u) >> 6u) << 4u);
    let m = (byte_at(at, j + 4u) >> 4u) | ((byte_at(at, j) >> 6u) << 4u);
    return vec2<f32>(f32(sc), f32(m));
}
fn q4v(b: u32, c: u32, qs: u32) -> vec4<f32> {
    let sb = b / 8u;
    let s = b % 8u;
    let dm = unpack2x16float(w[4u * sb]);
    let scm = scale_min(4u * sb + 1u, s);
    let d1 = dm.x * scm.x;
    let m1 = dm.y * scm.y;
#if W_Q5_K
    let base = qs + sb * 40u;
    let q = nibs(base + 8u + 4u * s, c) + 16.0 * bit4(w[base + s] >> (4u * c));
#else
    let q = nibs(qs + sb * 32u + 4u * s, c);
#endif
    return d1 * q - m1;
}
#endif

#if W_Q6_K
fn q4v(b: u32, c: u32, qs: u32) -> vec4<f32> {
    let sb = b / 8u;
    let s = b % 8u;
    let d = unpack2x16float(w[sb >> 1u])[sb & 1u];
    let base = qs + sb * 52u;
    let i = 2u * s + c / 4u;
    let sc = bitcast<i32>(w[base + i / 4u] << (24u - 8u * (i % 4u))) >> 24u;
    let dl = d * f32(sc);
    let lo = nibs(base + 4u + 4u * s, c);
    let hi = two4(w[base + 36u + 2u * s + c / 4u] >> (2u * (c % 4u)));
    return dl * (lo + 16.0 * hi - 32.0);
}
#endif

// kiln's zero-point formats: a d|z head word a block; value = (q − z)·d, in that order so
// that it equals the CPU reference bit for bit.
#if W_Q4_Z
fn q4v(b: u32, c: u32, qs: u32) -> vec4<f32> {
    let dz = unpack2x16float(w[b]);
    return (nibs(qs + b * 4u, c) - dz.y) * dz.x;
}
#endif

#if W_Q8_Z
fn q4v(b: u32, c: u32, qs: u32) -> vec4<f32> {
    let dz = unpack2x16float(w[b]);
    let x = w[qs + b * 8u + c];
    let q = vec4<f32>(vec4<u32>(x, x >> 8u, x >> 16u, x >> 24u) & vec4<u32>(0xffu));
    return (q - dz.y) * dz.x;
}
#endif
