// Write the K and V rows of new tokens into their slots of a paged pool laid out as
// [blocks * block_size (slots), kv_heads, head_dim].
// KV_F32: one thread per element. KV_F16: one thread per pair (f16 packed two per word).
// KV_I8:  one thread per (token, head): scale = max|x| / 127, four i8 per word, and the scale
//         stored per (slot, head).
// KV_I4:  one thread per (token, head): asymmetric, scale = (max - min) / 15 and zero = min,
//         both rounded to f16 (and packed in one word per (slot, head)) before quantizing
//         against them; eight nibbles per word, element 8w + j at bits 4j of word w.

struct Params {
    tokens: u32,
    kv_heads: u32,
    head_dim: u32,
    _pad: u32,
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

const F16_MAX: f32 = 65504.0;

// The row's (scale, zero) as f16 holds them: its range in 15 steps from its minimum.
fn i4_params(src: u32, n: u32, is_k: bool) -> vec2<f32> {
    var lo = bitcast<f32>(0x7f800000u);
    var hi = -lo;
    for (var d = 0u; d < n; d++) {
        let x = select(v_new[src + d], k_new[src + d], is_k);
        lo = min(lo, x);
        hi = max(hi, x);
    }
    let sz = vec2<f32>((hi - lo) / 15.0, lo);
    return unpack2x16float(pack2x16float(clamp(sz, vec2<f32>(-F16_MAX), vec2<f32>(F16_MAX))));
}

fn quant_i4(x: f32, sz: vec2<f32>, inv: f32) -> u32 {
    return u32(clamp(round((x - sz.y) * inv), 0.0, 15.0));
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
    let ksz = i4_params(src, p.head_dim, true);
    let vsz = i4_params(src, p.head_dim, false);
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
            kw |= quant_i4(k_new[src + 8u * w + j], ksz, ki) << (4u * j);
            vw |= quant_i4(v_new[src + 8u * w + j], vsz, vi) << (4u * j);
        }
        k_pool[dst + w] = kw;
        v_pool[dst + w] = vw;
    }
#endif
}
