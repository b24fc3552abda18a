// Paged attention for a mixed batch: one 64-thread workgroup per (query token, query head,
// run of its keys).
// A query at absolute position `pos` attends to keys pos - window + 1 ..= pos (all of 0..=pos
// without a window) of its own sequence, found through the sequence's block table: causal
// within a prefill chunk, full attention to the cached prefix, one token for decode. The keys
// of the current chunk are in the pool already (kv_write runs first in the same submit).
// Keys are taken 64 at a time: each thread scores one key, then the tile's probabilities are
// folded into a running (max, sum, accumulator) — the online softmax — with each thread owning
// output dimensions lid, lid + 64, ...  GQA: query head h reads kv head h / (heads / kv_heads).
//
// Split keys (flash-decoding): a step of few query rows (decode) has too few (token, head)
// pairs to fill a GPU, so the launcher splits each query's keys into `splits` runs of
// `split_keys` and a workgroup takes one run. It writes its run's normalized output with the
// run's (max, sum) after it, a row of head_dim + 2 in `out`, and attention_combine.wgsl
// weighs the runs together. A run past the query's keys (a shorter sequence of the batch)
// writes a sum of zero. With one run, `out` is the output itself.

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
    // Query groups of paged_attention_rows.wgsl's shared form (unused here).
    groups: u32,
    // Runs each query's keys are split into, and the keys of a run (with one run: all).
    splits: u32,
    split_keys: u32,
    _pad0: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
// Per query token: (offset of its sequence's block table in `tables`, absolute position).
@group(0) @binding(2) var<storage, read> info: array<u32>;
@group(0) @binding(3) var<storage, read> tables: array<u32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
#if KV_F32
@group(0) @binding(5) var<storage, read> k_pool: array<f32>;
@group(0) @binding(6) var<storage, read> v_pool: array<f32>;
#else
@group(0) @binding(5) var<storage, read> k_pool: array<u32>;
@group(0) @binding(6) var<storage, read> v_pool: array<u32>;
#endif
#if SINKS
// Attention sinks (GPT-OSS), F32 [heads]: a logit per query head that joins the softmax with
// no value row. A query's first run starts its online softmax from it,
// as from a key before the first (the other runs from nothing).
@group(0) @binding({{SINKS_AT}}) var<storage, read> sinks: array<f32>;
#endif
#if KV_I8
@group(0) @binding(7) var<storage, read> k_scale: array<f32>;
@group(0) @binding(8) var<storage, read> v_scale: array<f32>;
#endif
#if KV_I4
// Per (slot, kv head): the f16 scale (low half) and zero point (high half).
@group(0) @binding(7) var<storage, read> k_scale: array<u32>;
@group(0) @binding(8) var<storage, read> v_scale: array<u32>;
// [kv_heads, CENTRED_PAIRS] key centres (centre.wgsl): each score gets its key's back.
@group(0) @binding(9) var<storage, read> centres: array<vec4<u32>>;

fn i4_at(word: u32, i: u32, sz: u32) -> f32 {
    let s = unpack2x16float(sz);
    return f32((word >> (4u * (i & 7u))) & 0xfu) * s.x + s.y;
}
#endif

const MAX_D: u32 = 256u;
const HEAD_DIM: u32 = {{HEAD_DIM}}u;

var<workgroup> qs: array<f32, MAX_D>;
var<workgroup> probs: array<f32, 64>;
var<workgroup> tile_slots: array<u32, 64>;
var<workgroup> wg_pos: u32;
var<workgroup> wg_table: u32;

#if KV_I4
// The query's share of its kv head's centres (`centre_query`).
var<workgroup> cq: array<vec4<f32>, CENTRED_PAIRS>;

// `hadamard` on the workgroup's `qs` (one invocation runs it).
fn rotate_qs() {
    var r: array<f32, 256>;
    for (var d = 0u; d < HEAD_DIM; d++) {
        r[d] = qs[d];
    }
    hadamard(&r, HEAD_DIM, p.had_norm);
    for (var d = 0u; d < HEAD_DIM; d++) {
        qs[d] = r[d];
    }
}
#endif

// Element d of the K (or V) row at `slot`, kv head `h`.
fn k_at(slot: u32, h: u32, d: u32) -> f32 {
    let i = (slot * p.kv_heads + h) * HEAD_DIM + d;
#if KV_F32
    return k_pool[i];
#endif
#if KV_F16
    return unpack2x16float(k_pool[i >> 1u])[i & 1u];
#endif
#if KV_I8
    let q8 = bitcast<i32>(k_pool[i >> 2u] << (24u - 8u * (i & 3u))) >> 24u;
    return f32(q8) * k_scale[slot * p.kv_heads + h];
#endif
#if KV_I4
    return i4_at(k_pool[i >> 3u], i, k_scale[slot * p.kv_heads + h]);
#endif
}

fn v_at(slot: u32, h: u32, d: u32) -> f32 {
    let i = (slot * p.kv_heads + h) * HEAD_DIM + d;
#if KV_F32
    return v_pool[i];
#endif
#if KV_F16
    return unpack2x16float(v_pool[i >> 1u])[i & 1u];
#endif
#if KV_I8
    let q8 = bitcast<i32>(v_pool[i >> 2u] << (24u - 8u * (i & 3u))) >> 24u;
    return f32(q8) * v_scale[slot * p.kv_heads + h];
#endif
#if KV_I4
    return i4_at(v_pool[i >> 3u], i, v_scale[slot * p.kv_heads + h]);
#endif
}

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let g = wid.x + wid.y * nwg.x;
    if (g >= p.tokens * p.heads * p.splits) {
        return;
    }
    let split = g % p.splits;
    let t = g / p.splits / p.heads;
    let h = g / p.splits % p.heads;
    let kvh = h / (p.heads / p.kv_heads);
    if (lid == 0u) {
        wg_table = info[2u * t];
        wg_pos = info[2u * t + 1u];
    }
    let qbase = (t * p.heads + h) * HEAD_DIM;
    for (var d = lid; d < HEAD_DIM; d += 64u) {
        qs[d] = q[qbase + d] * p.scale;
    }
#if KV_I4
    // The cache holds rotated rows: rotate the query alike (q·k = Hq·Hk), once the centres
    // have taken its share from the unrotated one.
    workgroupBarrier();
    if (lid < CENTRED_PAIRS) {
        let e = centres[kvh * CENTRED_PAIRS + lid];
        cq[lid] = centre_query(e, qs[e.x & 0xffffu], qs[e.x >> 16u]);
    }
    workgroupBarrier();
    if (lid == 0u) {
        rotate_qs();
    }
#endif
    // Uniform copies, so the loop below (which has barriers) stays in uniform control flow.
    let pos = workgroupUniformLoad(&wg_pos);
    let table = workgroupUniformLoad(&wg_table);
    var first = 0u;
    if (p.window > 0u && pos + 1u > p.window) {
        first = pos + 1u - p.window;
    }
    // This workgroup's run of keys: first ..= last.
    var last = pos;
    if (p.splits > 1u) {
        first += split * p.split_keys;
        last = min(pos, first + p.split_keys - 1u);
        if (first > pos) {
            // Past the query's keys: nothing to weigh.
            let row = g * (HEAD_DIM + 2u);
            for (var d = lid; d < HEAD_DIM; d += 64u) {
                out[row + d] = 0.0;
            }
            if (lid == 0u) {
                out[row + HEAD_DIM] = 0.0;
                out[row + HEAD_DIM + 1u] = 0.0;
            }
            return;
        }
    }
    let neg_inf = bitcast<f32>(0xff800000u);
    var m = neg_inf;
    var l = 0.0;
#if SINKS
    if (split == 0u) {
        m = sinks[h];
        l = 1.0;
    }
#endif
    var acc: array<f32, 4>;
    for (var base = first; base <= last; base += 64u) {
        let j = base + lid;
        var s = neg_inf;
        var slot = 0u;
        if (j <= last) {
            slot = tables[table + j / p.block_size] * p.block_size + j % p.block_size;
            s = 0.0;
            for (var d = 0u; d < HEAD_DIM; d++) {
                s += qs[d] * k_at(slot, kvh, d);
            }
#if KV_I4
            for (var c = 0u; c < CENTRED_PAIRS; c++) {
                s += centre_term(cq[c], j);
            }
#endif
        }
        probs[lid] = s;
        tile_slots[lid] = slot;
        workgroupBarrier();
        var mt = neg_inf;
        for (var i = 0u; i < 64u; i++) {
            mt = max(mt, probs[i]);
        }
        let m_new = max(m, mt);
        let alpha = exp(m - m_new);
        workgroupBarrier();
        probs[lid] = exp(s - m_new);
        workgroupBarrier();
        var ls = 0.0;
        for (var i = 0u; i < 64u; i++) {
            ls += probs[i];
        }
        l = l * alpha + ls;
        let n = min(64u, last + 1u - base);
        for (var r = 0u; r < 4u; r++) {
            let d = lid + 64u * r;
            if (d < HEAD_DIM) {
                var a = acc[r] * alpha;
                for (var i = 0u; i < n; i++) {
                    a += probs[i] * v_at(tile_slots[i], kvh, d);
                }
                acc[r] = a;
            }
        }
        m = m_new;
        workgroupBarrier();
    }
    // Where the output goes: the query's row, or this run's row of the parts.
    var out_row = qbase;
    if (p.splits > 1u) {
        out_row = g * (HEAD_DIM + 2u);
    }
#if KV_I4
    // The output mixes rotated V rows: rotate it back (through `qs`, no longer read).
    workgroupBarrier();
    for (var r = 0u; r < 4u; r++) {
        let d = lid + 64u * r;
        if (d < HEAD_DIM) {
            qs[d] = acc[r] / l;
        }
    }
    workgroupBarrier();
    if (lid == 0u) {
        rotate_qs();
    }
    workgroupBarrier();
    for (var r = 0u; r < 4u; r++) {
        let d = lid + 64u * r;
        if (d < HEAD_DIM) {
            out[out_row + d] = qs[d];
        }
    }
#else
    for (var r = 0u; r < 4u; r++) {
        let d = lid + 64u * r;
        if (d < HEAD_DIM) {
            out[out_row + d] = acc[r] / l;
        }
    }
#endif
    if (p.splits > 1u && lid == 0u) {
        out[out_row + HEAD_DIM] = m;
        out[out_row + HEAD_DIM + 1u] = l;
    }
}
