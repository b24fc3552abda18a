// Write the K and V rows of new tokens into their slots of a paged pool laid out as
// [blocks * block_size (slots), kv_heads, head_dim].
// KV_F32: one thread per element. KV_F16: one thread per pair (f16 packed two per word).
// KV_I8:  one thread per (token, head): scale = max|x| / 127, four i8 per word, and the scale
//         stored per (slot, head).
// KV_I4:  one thread per (token, head): the row rotated by `hadamard`, then asymmetric:
//         scale = range / 15 and zero = its low end, for the range of the rotated row shrunk
//         around its midpoint by the clip (of CLIPS) with the least squared error, both
//         rounded to f16 (packed in one word per (slot, head)) before quantizing against
//         them; eight nibbles per word, element 8w + j at bits 4j of word w. A key has its
//         head's centres at its position (centre.wgsl) taken out before the rotation.

struct Params {
    tokens: u32,
    kv_heads: u32,
    head_dim: u32,
    // 1/sqrt(the INT4 rotation's block size).
    had_norm: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> k_new: array<f32>;
@group(0) @binding(2) var<storage, read> v_new: array<f32>;
@group(0) @binding(3) var<storage, read> slots: array<u32>;
#if KV_F32
@group(0) @binding(4) var<storage, read_write> k_pool: array<f32>;
@group(0) @binding(5) var<storage, read_write> v_pool: array<f32>;
#else
@group(0) @binding(4) var<storage, read_write> k_pool: array<u32>;
@group(0) @binding(5) var<storage, read_write> v_pool: array<u32>;
#endif
#if KV_I8
@group(0) @binding(6) var<storage, read_write> k_scale: array<f32>;
@group(0) @binding(7) var<storage, read_write> v_scale: array<f32>;

fn quant_i8(x: f32, inv: f32) -> u32 {
    return u32(i32(round(x * inv)) & 0xff);
}
#endif
#if KV_I4
@group(0) @binding(6) var<storage, read_write> k_scale: array<u32>;
@group(0) @binding(7) var<storage, read_write> v_scale: array<u32>;
// Per token: (block table offset, absolute position), as the attention batch has it.
@group(0) @binding(8) var<storage, read> info: array<u32>;
// [kv_heads, CENTRED_PAIRS] key centres.
@group(0) @binding(9) var<storage, read> centres: array<vec4<u32>>;

const F16_MAX: f32 = 65504.0;
// Range shrink factors tried per row (cache.rs `INT4_CLIPS`).
const CLIPS = array<f32, 6>(1.0, 0.95, 0.9, 0.85, 0.8, 0.75);

fn level_i4(x: f32, sz: vec2<f32>, inv: f32) -> f32 {
    return clamp(round((x - sz.y) * inv), 0.0, 15.0);
}

// The rotated row's (scale, zero) as f16 holds them (cache.rs `int4_params`).
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
        let sz = unpack2x16float(pack2x16float(clamp(raw, vec2<f32>(-F16_MAX), vec2<f32>(F16_MAX))));
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

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let e = (wid.x + wid.y * nwg.x) * 64u + lid;
#if KV_F32
    if (e >= p.tokens * p.kv_heads * p.head_dim) {
        return;
    }
    let row = p.kv_heads * p.head_dim;
    let t = e / row;
    let dst = slots[t] * row + e % row;
    k_pool[dst] = k_new[e];
    v_pool[dst] = v_new[e];
#endif
#if KV_F16
    if (e * 2u >= p.tokens * p.kv_heads * p.head_dim) {
        return;
    }
    let row = p.kv_heads * p.head_dim / 2u;
    let t = e / row;
    let dst = slots[t] * row + e % row;
    k_pool[dst] = pack2x16float(vec2<f32>(k_new[2u * e], k_new[2u * e + 1u]));
    v_pool[dst] = pack2x16float(vec2<f32>(v_new[2u * e], v_new[2u * e + 1u]));
#endif
#if KV_I8
    if (e >= p.tokens * p.kv_heads) {
        return;
    }
    let t = e / p.kv_heads;
    let h = e % p.kv_heads;
    let src = e * p.head_dim;
    var ka = 0.0;
    var va = 0.0;
    for (var d = 0u; d < p.head_dim; d++) {
        ka = max(ka, abs(k_new[src + d]));
        va = max(va, abs(v_new[src + d]));
    }
    let kd = ka / 127.0;
    let vd = va / 127.0;
    let ki = select(0.0, 1.0 / kd, kd > 0.0);
    let vi = select(0.0, 1.0 / vd, vd > 0.0);
    let sh = slots[t] * p.kv_heads + h;
    k_scale[sh] = kd;
    v_scale[sh] = vd;
    let dst = sh * p.head_dim / 4u;
    for (var w = 0u; w < p.head_dim / 4u; w++) {
        var kw = 0u;
        var vw = 0u;
        for (var j = 0u; j < 4u; j++) {
            kw |= quant_i8(k_new[src + 4u * w + j], ki) << (8u * j);
            vw |= quant_i8(v_new[src + 4u * w + j], vi) << (8u * j);
        }
        k_pool[dst + w] = kw;
        v_pool[dst + w] = vw;
    }
#endif
#if KV_I4
    if (e >= p.tokens * p.kv_heads) {
        return;
    }
    let t = e / p.kv_heads;
    let h = e % p.kv_heads;
    let src = e * p.head_dim;
    var kr: array<f32, 256>;
    var vr: array<f32, 256>;
    for (var d = 0u; d < p.head_dim; d++) {
        kr[d] = k_new[src + d];
        vr[d] = v_new[src + d];
    }
    let kpos = info[2u * t + 1u];
    for (var c = 0u; c < CENTRED_PAIRS; c++) {
        let e = centres[h * CENTRED_PAIRS + c];
        let m = centre_at(e, kpos);
        kr[e.x & 0xffffu] -= m.x;
        kr[e.x >> 16u] -= m.y;
    }
    hadamard(&kr, p.head_dim, p.had_norm);
    hadamard(&vr, p.head_dim, p.had_norm);
    let ksz = i4_params(&kr, p.head_dim);
    let vsz = i4_params(&vr, p.head_dim);
    let ki = select(0.0, 1.0 / ksz.x, ksz.x > 0.0);
    let vi = select(0.0, 1.0 / vsz.x, vsz.x > 0.0);
    let sh = slots[t] * p.kv_heads + h;
    k_scale[sh] = pack2x16float(ksz);
    v_scale[sh] = pack2x16float(vsz);
    let dst = sh * p.head_dim / 8u;
    for (var w = 0u; w < p.head_dim / 8u; w++) {
        var kw = 0u;
        var vw = 0u;
        for (var j = 0u; j < 8u; j++) {
            kw |= u32(level_i4(kr[8u * w + j], ksz, ki)) << (4u * j);
            vw |= u32(level_i4(vr[8u * w + j], vsz, vi)) << (4u * j);
        }
        k_pool[dst + w] = kw;
        v_pool[dst + w] = vw;
    }
#endif
}
