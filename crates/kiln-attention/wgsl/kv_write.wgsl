// A step's Q, K and V rows made ready for attention, in one launch: each query head row
// (optionally RMS-normed per head, then rotated by RoPE) written to `q_out`, each K row
// (normed and rotated alike) and V row written into their slot of a paged pool laid out as
// [blocks * block_size (slots), kv_heads, head_dim]. One invocation per (token, head row) on
// CPU-type adapters, one workgroup per row on GPUs (PAR, below): rows 0..heads are query
// heads, the rest kv heads (K and V together).
//
// Sources: Q, K and V are read from their own bindings at a row stride and column offset
// each, so one stacked projection [tokens, (heads + 2·kv_heads)·head_dim] can be bound three
// times, or three tensors once each. Positions are the batch's (`info`: per token, its
// block table offset and absolute position). RoPE pairs (j, j + rot/2) (half-split) or
// (2j, 2j + 1) (interleaved) from the table `cs` of (cos, sin) per position and pair;
// dimensions past `rot` pass through; rot = 0 rotates nothing.
//
// Pool formats:
// KV_F32, KV_F16: the values (f16 packed two per word, rounded to nearest even: `f16_bits`).
// KV_I8:  scale = max|x| / 127, four i8 per word, the scale stored per (slot, head).
// KV_I4:  the row rotated by `hadamard`, then asymmetric: scale = range / 15 and zero = its
//         low end, for the range of the rotated row shrunk around its midpoint by the clip
//         (of CLIPS) with the least squared error, both rounded to f16 (packed in one word
//         per (slot, head)) before quantizing against them; eight nibbles per word, element
//         8w + j at bits 4j of word w. A key has its head's centres at its position
//         (centre.wgsl) taken out before the rotation.

struct Params {
    tokens: u32,
    kv_heads: u32,
    head_dim: u32,
    // 1/sqrt(the INT4 rotation's block size).
    had_norm: f32,
    // Query heads (0: K and V only).
    heads: u32,
    q_stride: u32,
    q_col: u32,
    k_stride: u32,
    k_col: u32,
    v_stride: u32,
    v_col: u32,
    // Rotated dimensions (0: no RoPE), positions in the table, 1 for the interleaved layout.
    rot: u32,
    max_pos: u32,
    interleaved: u32,
    // 1 when Q and K rows are RMS-normed per head first, and its epsilon.
    qk_norm: u32,
    eps: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q_src: array<f32>;
@group(0) @binding(2) var<storage, read> k_src: array<f32>;
@group(0) @binding(3) var<storage, read> v_src: array<f32>;
@group(0) @binding(4) var<storage, read> slots: array<u32>;
@group(0) @binding(5) var<storage, read> info: array<u32>;
@group(0) @binding(6) var<storage, read> cs: array<f32>;
@group(0) @binding(7) var<storage, read> q_norm: array<f32>;
@group(0) @binding(8) var<storage, read> k_norm: array<f32>;
@group(0) @binding(9) var<storage, read_write> q_out: array<f32>;
#if KV_F32
@group(0) @binding(10) var<storage, read_write> k_pool: array<f32>;
@group(0) @binding(11) var<storage, read_write> v_pool: array<f32>;
#else
@group(0) @binding(10) var<storage, read_write> k_pool: array<u32>;
@group(0) @binding(11) var<storage, read_write> v_pool: array<u32>;
#endif
// f32 to f16 bits, rounded to nearest, ties to even, as the host's `half::f16::from_f32`
// rounds. WGSL leaves `pack2x16float`'s rounding to the driver (some truncate), and an f16
// that differs by one unit from the host's moves an INT4 row's levels, so every f16 the cache
// stores is rounded here. Finite values past the f16 range become infinities, NaN stays NaN.
fn f16_bits(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    let sign = (b >> 16u) & 0x8000u;
    let a = b & 0x7fffffffu;
    if (a > 0x7f800000u) {
        return sign | 0x7e00u;
    }
    if (a >= 0x477ff000u) {
        // At or past 65520, halfway from 65504 to the next power of two: infinity.
        return sign | 0x7c00u;
    }
    if (a >= 0x38800000u) {
        // Normal: rebias the exponent (127 to 15), round the 13 dropped mantissa bits.
        let m = a - 0x38000000u;
        return sign | ((m + 0xfffu + ((m >> 13u) & 1u)) >> 13u);
    }
    let e = a >> 23u;
    if (e < 102u) {
        // Below 2^-25, half the least subnormal: zero.
        return sign;
    }
    // Subnormal: the significand in units of 2^-24, rounded.
    let mant = (a & 0x7fffffu) | 0x800000u;
    let shift = 126u - e;
    let q = mant >> shift;
    let rem = mant & ((1u << shift) - 1u);
    let half = 1u << (shift - 1u);
    let up = rem > half || (rem == half && (q & 1u) == 1u);
    return sign | (q + select(0u, 1u, up));
}

fn pack_f16(v: vec2<f32>) -> u32 {
    return f16_bits(v.x) | (f16_bits(v.y) << 16u);
}

#if KV_I8
@group(0) @binding(12) var<storage, read_write> k_scale: array<f32>;
@group(0) @binding(13) var<storage, read_write> v_scale: array<f32>;

fn quant_i8(x: f32, inv: f32) -> u32 {
    return u32(i32(round(x * inv)) & 0xff);
}
#endif
#if KV_I4
@group(0) @binding(12) var<storage, read_write> k_scale: array<u32>;
@group(0) @binding(13) var<storage, read_write> v_scale: array<u32>;
// [kv_heads, CENTRED_PAIRS] key centres.
@group(0) @binding(14) var<storage, read> centres: array<vec4<u32>>;

const F16_MAX: f32 = 65504.0;
// Range shrink factors tried per row (stored.rs `INT4_CLIPS`).
const CLIPS = array<f32, 6>(1.0, 0.95, 0.9, 0.85, 0.8, 0.75);

fn level_i4(x: f32, sz: vec2<f32>, inv: f32) -> f32 {
    return clamp(round((x - sz.y) * inv), 0.0, 15.0);
}

// The rotated row's (scale, zero) as f16 holds them (stored.rs `int4_params`).
fn i4_params(r: ptr<function, array<f32, 256>>, n: u32) -> vec2<f32> {
    var lo = bitcast<f32>(0x7f800000u);
    var hi = -lo;
    for (var d = 0u; d < n; d++) {
        lo = min(lo, (*r)[d]);
        hi = max(hi, (*r)[d]);
    }
    let mid = 0.5 * (lo + hi);
    let half_range = 0.5 * (hi - lo);
    var best = vec2<f32>(0.0);
    var best_err = bitcast<f32>(0x7f800000u);
    for (var c = 0u; c < 6u; c++) {
        let clip = CLIPS[c];
        let raw = vec2<f32>(2.0 * half_range * clip / 15.0, mid - half_range * clip);
        let sz = unpack2x16float(pack_f16(clamp(raw, vec2<f32>(-F16_MAX), vec2<f32>(F16_MAX))));
        let inv = select(0.0, 1.0 / sz.x, sz.x > 0.0);
        var err = 0.0;
        for (var d = 0u; d < n; d++) {
            let e = level_i4((*r)[d], sz, inv) * sz.x + sz.y - (*r)[d];
            err += e * e;
        }
        if (err < best_err) {
            best_err = err;
            best = sz;
        }
    }
    return best;
}
#endif

// Per-head RMSNorm of a row by the weights of Q (`key` false) or K.
fn norm_row(r: ptr<function, array<f32, 256>>, key: bool) {
    var ss = 0.0;
    for (var d = 0u; d < p.head_dim; d++) {
        ss += (*r)[d] * (*r)[d];
    }
    let scale = inverseSqrt(ss / f32(p.head_dim) + p.eps);
    for (var d = 0u; d < p.head_dim; d++) {
        var w = q_norm[d];
        if (key) {
            w = k_norm[d];
        }
        (*r)[d] = (*r)[d] * scale * w;
    }
}

// RoPE of a row at position `pos`.
fn rope_row(r: ptr<function, array<f32, 256>>, pos: u32) {
    if (p.rot == 0u || pos >= p.max_pos) {
        return;
    }
    let half = p.rot / 2u;
    for (var j = 0u; j < half; j++) {
        var a = j;
        var b = j + half;
        if (p.interleaved == 1u) {
            a = 2u * j;
            b = 2u * j + 1u;
        }
        let at = (pos * half + j) * 2u;
        let c = cs[at];
        let s = cs[at + 1u];
        let xa = (*r)[a];
        let xb = (*r)[b];
        (*r)[a] = xa * c - xb * s;
        (*r)[b] = xb * c + xa * s;
    }
}

// Store the head row `r` at (slot, head) of a pool: the key pool when `key`.
fn store(r: ptr<function, array<f32, 256>>, slot: u32, h: u32, key: bool, pos: u32) {
    let n = p.head_dim;
#if KV_F32
    let dst = (slot * p.kv_heads + h) * n;
    for (var d = 0u; d < n; d++) {
        if (key) {
            k_pool[dst + d] = (*r)[d];
        } else {
            v_pool[dst + d] = (*r)[d];
        }
    }
#endif
#if KV_F16
    let dst = (slot * p.kv_heads + h) * n / 2u;
    for (var w = 0u; w < n / 2u; w++) {
        let v = pack_f16(vec2<f32>((*r)[2u * w], (*r)[2u * w + 1u]));
        if (key) {
            k_pool[dst + w] = v;
        } else {
            v_pool[dst + w] = v;
        }
    }
#endif
#if KV_I8
    var a = 0.0;
    for (var d = 0u; d < n; d++) {
        a = max(a, abs((*r)[d]));
    }
    let sd = a / 127.0;
    let inv = select(0.0, 1.0 / sd, sd > 0.0);
    let sh = slot * p.kv_heads + h;
    if (key) {
        k_scale[sh] = sd;
    } else {
        v_scale[sh] = sd;
    }
    let dst = sh * n / 4u;
    for (var w = 0u; w < n / 4u; w++) {
        var word = 0u;
        for (var j = 0u; j < 4u; j++) {
            word |= quant_i8((*r)[4u * w + j], inv) << (8u * j);
        }
        if (key) {
            k_pool[dst + w] = word;
        } else {
            v_pool[dst + w] = word;
        }
    }
#endif
#if KV_I4
    if (key) {
        for (var c = 0u; c < CENTRED_PAIRS; c++) {
            let e = centres[h * CENTRED_PAIRS + c];
            let m = centre_at(e, pos);
            (*r)[e.x & 0xffffu] -= m.x;
            (*r)[e.x >> 16u] -= m.y;
        }
    }
    hadamard(r, n, p.had_norm);
    let sz = i4_params(r, n);
    let inv = select(0.0, 1.0 / sz.x, sz.x > 0.0);
    let sh = slot * p.kv_heads + h;
    if (key) {
        k_scale[sh] = pack_f16(sz);
    } else {
        v_scale[sh] = pack_f16(sz);
    }
    let dst = sh * n / 8u;
    for (var w = 0u; w < n / 8u; w++) {
        var word = 0u;
        for (var j = 0u; j < 8u; j++) {
            word |= u32(level_i4((*r)[8u * w + j], sz, inv)) << (4u * j);
        }
        if (key) {
            k_pool[dst + w] = word;
        } else {
            v_pool[dst + w] = word;
        }
    }
#endif
}

#if PAR
// The GPU form: one 64-thread workgroup per (token, head row), the row in workgroup memory,
// each thread taking dimensions lid, lid + 64, ... of the load, the norm (its sum of
// squares reduced across the workgroup), RoPE (pairs j = lid, lid + 64, ...) and the F32/F16
// store; INT8 and INT4 rows (a scale over the whole row, INT4's rotation and clip search)
// are stored by one thread through `store`, as the one-invocation form does.

var<workgroup> rs: array<f32, 256>;
var<workgroup> red: array<f32, 64>;

// The workgroup's sum of `v` over its threads (every thread gets it).
fn wg_sum(v: f32, lid: u32) -> f32 {
    red[lid] = v;
    workgroupBarrier();
    for (var w = 32u; w > 0u; w >>= 1u) {
        if (lid < w) {
            red[lid] += red[lid + w];
        }
        workgroupBarrier();
    }
    let total = red[0];
    workgroupBarrier();
    return total;
}

// Per-head RMSNorm of the row in `rs` by the weights of Q (`key` false) or K.
fn norm_rs(key: bool, lid: u32) {
    var ss = 0.0;
    for (var d = lid; d < p.head_dim; d += 64u) {
        ss += rs[d] * rs[d];
    }
    let scale = inverseSqrt(wg_sum(ss, lid) / f32(p.head_dim) + p.eps);
    for (var d = lid; d < p.head_dim; d += 64u) {
        var w = q_norm[d];
        if (key) {
            w = k_norm[d];
        }
        rs[d] = rs[d] * scale * w;
    }
    workgroupBarrier();
}

// RoPE of the row in `rs` at position `pos` (as `rope_row`).
fn rope_rs(pos: u32, lid: u32) {
    if (p.rot == 0u || pos >= p.max_pos) {
        return;
    }
    let half = p.rot / 2u;
    for (var j = lid; j < half; j += 64u) {
        var a = j;
        var b = j + half;
        if (p.interleaved == 1u) {
            a = 2u * j;
            b = 2u * j + 1u;
        }
        let at = (pos * half + j) * 2u;
        let c = cs[at];
        let s = cs[at + 1u];
        let xa = rs[a];
        let xb = rs[b];
        rs[a] = xa * c - xb * s;
        rs[b] = xb * c + xa * s;
    }
}

// Store the row in `rs` at (slot, head) of a pool (the key pool when `key`).
fn store_rs(slot: u32, h: u32, key: bool, pos: u32, lid: u32) {
    workgroupBarrier();
    let n = p.head_dim;
#if KV_F32
    let dst = (slot * p.kv_heads + h) * n;
    for (var d = lid; d < n; d += 64u) {
        if (key) {
            k_pool[dst + d] = rs[d];
        } else {
            v_pool[dst + d] = rs[d];
        }
    }
#endif
#if KV_F16
    let dst = (slot * p.kv_heads + h) * n / 2u;
    for (var w = lid; w < n / 2u; w += 64u) {
        let v = pack_f16(vec2<f32>(rs[2u * w], rs[2u * w + 1u]));
        if (key) {
            k_pool[dst + w] = v;
        } else {
            v_pool[dst + w] = v;
        }
    }
#endif
#if KV_SCALED
    if (lid == 0u) {
        var r: array<f32, 256>;
        for (var d = 0u; d < n; d++) {
            r[d] = rs[d];
        }
        store(&r, slot, h, key, pos);
    }
#endif
    workgroupBarrier();
}

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let e = wid.x + wid.y * nwg.x;
    let per_token = p.heads + p.kv_heads;
    if (e >= p.tokens * per_token) {
        return;
    }
    let t = e / per_token;
    let j = e % per_token;
    let pos = info[2u * t + 1u];
    let n = p.head_dim;
    if (j < p.heads) {
        let src = t * p.q_stride + p.q_col + j * n;
        for (var d = lid; d < n; d += 64u) {
            rs[d] = q_src[src + d];
        }
        workgroupBarrier();
        if (p.qk_norm == 1u) {
            norm_rs(false, lid);
        }
        rope_rs(pos, lid);
        workgroupBarrier();
        let dst = (t * p.heads + j) * n;
        for (var d = lid; d < n; d += 64u) {
            q_out[dst + d] = rs[d];
        }
        return;
    }
    let h = j - p.heads;
    let slot = slots[t];
    let ks = t * p.k_stride + p.k_col + h * n;
    for (var d = lid; d < n; d += 64u) {
        rs[d] = k_src[ks + d];
    }
    workgroupBarrier();
    if (p.qk_norm == 1u) {
        norm_rs(true, lid);
    }
    rope_rs(pos, lid);
    store_rs(slot, h, true, pos, lid);
    let vs = t * p.v_stride + p.v_col + h * n;
    for (var d = lid; d < n; d += 64u) {
        rs[d] = v_src[vs + d];
    }
    store_rs(slot, h, false, pos, lid);
}
#else
@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let e = (wid.x + wid.y * nwg.x) * 64u + lid;
    let per_token = p.heads + p.kv_heads;
    if (e >= p.tokens * per_token) {
        return;
    }
    let t = e / per_token;
    let j = e % per_token;
    let pos = info[2u * t + 1u];
    let n = p.head_dim;
    var r: array<f32, 256>;
    if (j < p.heads) {
        let src = t * p.q_stride + p.q_col + j * n;
        for (var d = 0u; d < n; d++) {
            r[d] = q_src[src + d];
        }
        if (p.qk_norm == 1u) {
            norm_row(&r, false);
        }
        rope_row(&r, pos);
        let dst = (t * p.heads + j) * n;
        for (var d = 0u; d < n; d++) {
            q_out[dst + d] = r[d];
        }
        return;
    }
    let h = j - p.heads;
    let slot = slots[t];
    let ks = t * p.k_stride + p.k_col + h * n;
    for (var d = 0u; d < n; d++) {
        r[d] = k_src[ks + d];
    }
    if (p.qk_norm == 1u) {
        norm_row(&r, true);
    }
    rope_row(&r, pos);
    store(&r, slot, h, true, pos);
    let vs = t * p.v_stride + p.v_col + h * n;
    for (var d = 0u; d < n; d++) {
        r[d] = v_src[vs + d];
    }
    store(&r, slot, h, false, pos);
}
#endif
