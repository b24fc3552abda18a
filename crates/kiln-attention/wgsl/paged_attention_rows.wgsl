// Paged attention for CPU-type adapters (lavapipe, SwiftShader), same contract as
// paged_attention.wgsl: one invocation per (query token, query head) walks its keys with the
// online softmax, holding Q and the output row in registers. Compilers there run
// invocations as SIMD lanes and turn each storage read into a per-lane loop, so K and V rows
// are read 16 bytes at a time and there are no workgroup barriers or shared-memory tiles.
// A query reads at most 65,535 keys here (the launcher checks; llvmpipe's loop cap).
//
// SHARED: the form for steps whose sequences bring several query tokens (prefill chunks,
// speculative verification). A workgroup takes one query head and up to 8 consecutive query
// tokens of one sequence (a query group: `info` holds, after the per-token pairs, each group's
// first token and token count), one token a lane, so the lanes walk the same keys and read
// each K and V row once between them: with SG (subgroups of at least 8 lanes) lane c reads
// the row's 16-byte word c (c + 8, ...) and the others take it by broadcast, one gather a
// row instead of one a lane; without, the row's words at workgroup-uniform addresses. A lane
// skips the keys its token does not see (past its position, before its window).

struct Params {
    tokens: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    block_size: u32,
    window: u32,
    scale: f32,
    // 1/sqrt(the INT4 rotation's block size).
    had_norm: f32,
    // SHARED: query groups (after the 2·tokens words of `info`).
    groups: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<vec4<f32>>;
// Per query token: (offset of its sequence's block table in `tables`, absolute position).
@group(0) @binding(2) var<storage, read> info: array<u32>;
@group(0) @binding(3) var<storage, read> tables: array<u32>;
@group(0) @binding(4) var<storage, read_write> out: array<vec4<f32>>;
#if KV_F32
@group(0) @binding(5) var<storage, read> k_pool: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read> v_pool: array<vec4<f32>>;
#else
@group(0) @binding(5) var<storage, read> k_pool: array<vec4<u32>>;
@group(0) @binding(6) var<storage, read> v_pool: array<vec4<u32>>;
#endif
#if KV_I8
@group(0) @binding(7) var<storage, read> k_scale: array<f32>;
@group(0) @binding(8) var<storage, read> v_scale: array<f32>;
#endif
#if KV_I4
// Per (slot, kv head): the f16 scale (low half) and zero point (high half).
@group(0) @binding(7) var<storage, read> k_scale: array<u32>;
@group(0) @binding(8) var<storage, read> v_scale: array<u32>;
// [kv_heads, CENTRED_PAIRS] key centres (centre.wgsl): each score gets its key's back
// (`centre_term` lines in `K_DOT`).
@group(0) @binding(9) var<storage, read> centres: array<vec4<u32>>;
#endif
#if SINKS
// Attention sinks (GPT-OSS), F32 [heads]: a logit per query head that joins the softmax with
// no value row. The online softmax starts from it, as from a key
// before the first.
@group(0) @binding({{SINKS_AT}}) var<storage, read> sinks: array<f32>;
#endif

const WG: u32 = 8u;
const D4: u32 = {{HEAD_DIM}}u / 4u;
// Elements one 16-byte read of the pool holds, and the vec4s they make.
#if KV_F32
const EPL: u32 = 4u;
#endif
#if KV_F16
const EPL: u32 = 8u;
#endif
#if KV_I8
const EPL: u32 = 16u;
#endif
#if KV_I4
const EPL: u32 = 32u;
#endif
const NL: u32 = {{HEAD_DIM}}u / EPL;
const VPL: u32 = EPL / 4u;

#if KV_I4
struct Part {
    a: vec4<f32>,
    b: vec4<f32>,
    c: vec4<f32>,
    d: vec4<f32>,
    e: vec4<f32>,
    f: vec4<f32>,
    g: vec4<f32>,
    h: vec4<f32>,
}
#else
struct Part {
    a: vec4<f32>,
    b: vec4<f32>,
    c: vec4<f32>,
    d: vec4<f32>,
}
#endif

fn i8x4(x: u32) -> vec4<f32> {
    return vec4<f32>(bitcast<vec4<i32>>(vec4<u32>(x << 24u, x << 16u, x << 8u, x)) >> vec4<u32>(24u));
}

// `k_dec`/`v_dec` turn one 16-byte word of row `row` of the pool into its elements;
// `k_part`/`v_part` read word l of the row and decode it.
#if KV_F32
fn k_dec(w: vec4<f32>, row: u32) -> Part {
    return Part(w, vec4<f32>(), vec4<f32>(), vec4<f32>());
}
fn v_dec(w: vec4<f32>, row: u32) -> Part {
    return Part(w, vec4<f32>(), vec4<f32>(), vec4<f32>());
}
#endif
#if KV_F16
fn h8(v: vec4<u32>) -> Part {
    return Part(vec4<f32>(unpack2x16float(v.x), unpack2x16float(v.y)),
        vec4<f32>(unpack2x16float(v.z), unpack2x16float(v.w)), vec4<f32>(), vec4<f32>());
}
fn k_dec(w: vec4<u32>, row: u32) -> Part {
    return h8(w);
}
fn v_dec(w: vec4<u32>, row: u32) -> Part {
    return h8(w);
}
#endif
#if KV_I8
fn b16(v: vec4<u32>, s: f32) -> Part {
    return Part(i8x4(v.x) * s, i8x4(v.y) * s, i8x4(v.z) * s, i8x4(v.w) * s);
}
fn k_dec(w: vec4<u32>, row: u32) -> Part {
    return b16(w, k_scale[row]);
}
fn v_dec(w: vec4<u32>, row: u32) -> Part {
    return b16(w, v_scale[row]);
}
#endif
#if KV_I4
// Elements 8j .. 8j + 7 of a word at bits 4j: two vec4s, dequantized as q·scale + zero.
fn n8(x: u32, s: vec2<f32>) -> array<vec4<f32>, 2> {
    let lo = (vec4<u32>(x) >> vec4<u32>(0u, 4u, 8u, 12u)) & vec4<u32>(0xfu);
    let hi = (vec4<u32>(x) >> vec4<u32>(16u, 20u, 24u, 28u)) & vec4<u32>(0xfu);
    return array<vec4<f32>, 2>(vec4<f32>(lo) * s.x + s.y, vec4<f32>(hi) * s.x + s.y);
}
fn b32(v: vec4<u32>, sz: u32) -> Part {
    let s = unpack2x16float(sz);
    let x = n8(v.x, s);
    let y = n8(v.y, s);
    let z = n8(v.z, s);
    let w = n8(v.w, s);
    return Part(x[0], x[1], y[0], y[1], z[0], z[1], w[0], w[1]);
}
fn k_dec(w: vec4<u32>, row: u32) -> Part {
    return b32(w, k_scale[row]);
}
// `hadamard` on a head row held as vec4s.
fn rotate(x: ptr<function, array<vec4<f32>, D4>>) {
    var r: array<f32, 256>;
    for (var c = 0u; c < D4; c++) {
        for (var j = 0u; j < 4u; j++) {
            r[4u * c + j] = (*x)[c][j];
        }
    }
    hadamard(&r, {{HEAD_DIM}}u, p.had_norm);
    for (var c = 0u; c < D4; c++) {
        (*x)[c] = vec4<f32>(r[4u * c], r[4u * c + 1u], r[4u * c + 2u], r[4u * c + 3u]);
    }
}
fn v_dec(w: vec4<u32>, row: u32) -> Part {
    return b32(w, v_scale[row]);
}
#endif
fn k_part(row: u32, l: u32) -> Part {
    return k_dec(k_pool[row * NL + l], row);
}
fn v_part(row: u32, l: u32) -> Part {
    return v_dec(v_pool[row * NL + l], row);
}

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    {{SG_ARG}}
) {
#if SHARED
    // Workgroup-uniform: the group, its head, its sequence's table and the keys it walks.
    let wgi = wid.x + wid.y * nwg.x;
    let gi = wgi / p.heads;
    if (gi >= p.groups) {
        return;
    }
    let h = wgi % p.heads;
    let g0 = info[2u * p.tokens + 2u * gi];
    let n = info[2u * p.tokens + 2u * gi + 1u];
    // Lanes past the group's tokens compute a copy of its last and do not write.
    let t = g0 + min(lid, n - 1u);
    let lane = {{SG_LANE}};
    let table = info[2u * g0];
#else
    let g = (wid.x + wid.y * nwg.x) * WG + lid;
    if (g >= p.tokens * p.heads) {
        return;
    }
    let t = g / p.heads;
    let h = g % p.heads;
    let table = info[2u * t];
#endif
    let kvh = h / (p.heads / p.kv_heads);
    let pos = info[2u * t + 1u];
    let qb = (t * p.heads + h) * D4;
    var qv: array<vec4<f32>, D4>;
    var acc: array<vec4<f32>, D4>;
    for (var c = 0u; c < D4; c++) {
        qv[c] = q[qb + c] * p.scale;
    }
#if KV_I4
    // The query's share of its kv head's centres, from the unrotated query; then the query
    // rotated as the cache's rows are (q·k = Hq·Hk).
    var cq: array<vec4<f32>, CENTRED_PAIRS>;
    for (var c = 0u; c < CENTRED_PAIRS; c++) {
        let e = centres[kvh * CENTRED_PAIRS + c];
        let lo = e.x & 0xffffu;
        let hi = e.x >> 16u;
        cq[c] = centre_query(e, qv[lo / 4u][lo % 4u], qv[hi / 4u][hi % 4u]);
    }
    rotate(&qv);
#endif
    var first = 0u;
    if (p.window > 0u && pos + 1u > p.window) {
        first = pos + 1u - p.window;
    }
#if SHARED
    // From the group's first token's first key to its last token's position.
    var start = 0u;
    let pos0 = info[2u * g0 + 1u];
    if (p.window > 0u && pos0 + 1u > p.window) {
        start = pos0 + 1u - p.window;
    }
    let last = info[2u * (g0 + n - 1u) + 1u];
#else
    let start = first;
    let last = pos;
#endif
#if SINKS
    var m = sinks[h];
    var l = 1.0;
#else
    var m = bitcast<f32>(0xff800000u);
    var l = 0.0;
#endif
    for (var j = start; j <= last; j++) {
        let slot = tables[table + j / p.block_size] * p.block_size + j % p.block_size;
        let row = slot * p.kv_heads + kvh;
        var s = 0.0;
        // K·Q and the V update are unrolled by the launcher (`K_DOT`, `V_ACC`): llvmpipe
        // caps the iterations of one outermost loop nest at 65,535, so per-dimension loops
        // inside this one would cut a query's keys short (at head_dim 256, after 499 keys).
{{K_DOT}}        // exp(-inf) = 0 rescales nothing on the first key.
#if SHARED
        // A key this lane's token does not see changes nothing.
        let live = j >= first && j <= pos;
        let m_new = select(m, max(m, s), live);
        let alpha = select(1.0, exp(m - m_new), live);
        let pj = select(0.0, exp(s - m_new), live);
#else
        let m_new = max(m, s);
        let alpha = exp(m - m_new);
        let pj = exp(s - m_new);
#endif
        l = l * alpha + pj;
{{V_ACC}}        m = m_new;
    }
    let inv = 1.0 / l;
    for (var c = 0u; c < D4; c++) {
        acc[c] = acc[c] * inv;
    }
#if KV_I4
    // The output mixes rotated V rows: rotate it back.
    rotate(&acc);
#endif
#if SHARED
    if (lid >= n) {
        return;
    }
#endif
    for (var c = 0u; c < D4; c++) {
        out[qb + c] = acc[c];
    }
}
