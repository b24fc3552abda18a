// DeepSeek-V4's compressed attention.
//
// POOL: one invocation per (entry, channel) of out [windows, width]: the softmax over the
// window's slots of gate + ape, weighting kv. Disjoint windows: slots are rows
// lead + w·ratio + j through column c. Overlapping (rows [a | b], width = cols / 2): the
// previous window's rows through a (column c), then window w's through b (column width + c);
// entry 0 has a previous window only when lead rows hold it.
//
// SCORE: one invocation per (query token t, entry s < visible[t]) of a group of queries
// from token g: scores[t - g, s] = scale · Σ_h w[t,h] · max(q[t,h]·key[s], 0).
//
// TOPK: one workgroup per query token t of the group over its scores; invocation i owns a contiguous run
// of the visible entries. The k-th largest score is found by bisection over the
// order-preserving u32 image of the f32 scores (32 counting rounds); then the entries above
// it, and those equal to it from the lowest entry up, are written in rising entry order.

struct Params {
    a: u32,
    b: u32,
    c: u32,
    d: u32,
    e: u32,
    f: u32,
    g: u32,
    h: u32,
    i: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;

#if POOL
// a = windows, b = width, c = cols, d = ratio, e = lead, f = overlap
@group(0) @binding(1) var<storage, read> kv: array<f32>;
@group(0) @binding(2) var<storage, read> gate: array<f32>;
@group(0) @binding(3) var<storage, read> ape: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

fn slot_logit(r: u32, col: u32) -> f32 {
    return gate[r * p.c + col] + ape[(r % p.d) * p.c + col];
}

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let i = (wid.x + wid.y * nwg.x) * 64u + lid;
    if (i >= p.a * p.b) {
        return;
    }
    let w = i / p.b;
    let ch = i % p.b;
    let own = p.e + w * p.d;
    var first = own;
    var own_col = ch;
    if (p.f == 1u) {
        own_col = p.b + ch;
        if (own >= p.d) {
            first = own - p.d;
        }
    }
    var mx = bitcast<f32>(0xff800000u);
    for (var r = first; r < own; r++) {
        mx = max(mx, slot_logit(r, ch));
    }
    for (var r = own; r < own + p.d; r++) {
        mx = max(mx, slot_logit(r, own_col));
    }
    var sum = 0.0;
    var acc = 0.0;
    for (var r = first; r < own; r++) {
        let e = exp(slot_logit(r, ch) - mx);
        sum += e;
        acc += e * kv[r * p.c + ch];
    }
    for (var r = own; r < own + p.d; r++) {
        let e = exp(slot_logit(r, own_col) - mx);
        sum += e;
        acc += e * kv[r * p.c + own_col];
    }
    out[w * p.b + ch] = acc / sum;
}
#endif

#if SCORE
// a = the group's tokens, b = heads, c = dim, d = entries, f = scale (f32 bits), g = first token,
// h = rows a block of the keys' pool (0: consecutive keys), i = where its table starts in
// `visible` (after the tokens' counts)
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> hw: array<f32>;
@group(0) @binding(3) var<storage, read> keys: array<f32>;
@group(0) @binding(4) var<storage, read> visible: array<u32>;
@group(0) @binding(5) var<storage, read_write> scores: array<f32>;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let i = (wid.x + wid.y * nwg.x) * 64u + lid;
    if (i >= p.a * p.d) {
        return;
    }
    let t = p.g + i / p.d;
    let s = i % p.d;
    if (s >= visible[t]) {
        return;
    }
    var kb = s * p.c;
    if (p.h != 0u) {
        kb = (visible[p.i + s / p.h] * p.h + s % p.h) * p.c;
    }
    var acc = 0.0;
    for (var h = 0u; h < p.b; h++) {
        let qb = (t * p.b + h) * p.c;
        var d = 0.0;
        for (var j = 0u; j < p.c; j++) {
            d += q[qb + j] * keys[kb + j];
        }
        acc += hw[t * p.b + h] * max(d, 0.0);
    }
    scores[i] = acc * bitcast<f32>(p.f);
}
#endif

#if TOPK
// a = the group's tokens, d = entries, e = k, g = first token
@group(0) @binding(1) var<storage, read> visible: array<u32>;
@group(0) @binding(2) var<storage, read> scores: array<f32>;
@group(0) @binding(3) var<storage, read_write> picks: array<u32>;

const WG: u32 = 64u;
const NO_ENTRY: u32 = 0xffffffffu;

var<workgroup> counts: array<u32, WG>;
var<workgroup> total: u32;

// Order-preserving image of an f32 in u32: a > b as floats iff key(a) > key(b).
fn order_key(v: f32) -> u32 {
    let b = bitcast<u32>(v);
    if ((b & 0x80000000u) != 0u) {
        return ~b;
    }
    return b | 0x80000000u;
}

// The sum of every invocation's `v`; all invocations call it, all get the sum.
fn wg_total(v: u32, lid: u32) -> u32 {
    counts[lid] = v;
    workgroupBarrier();
    if (lid == 0u) {
        var s = 0u;
        for (var j = 0u; j < WG; j++) {
            s += counts[j];
        }
        total = s;
    }
    workgroupBarrier();
    let s = total;
    workgroupBarrier();
    return s;
}

// What the invocations before `lid` hold in all (an exclusive prefix sum), and the total.
fn wg_before(v: u32, lid: u32) -> vec2<u32> {
    counts[lid] = v;
    workgroupBarrier();
    var before = 0u;
    for (var j = 0u; j < lid; j++) {
        before += counts[j];
    }
    var s = 0u;
    for (var j = 0u; j < WG; j++) {
        s += counts[j];
    }
    workgroupBarrier();
    return vec2<u32>(before, s);
}

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let local = wid.x + wid.y * nwg.x;
    // Uniform per workgroup, so the barriers below stay in uniform control flow.
    if (local >= p.a) {
        return;
    }
    let t = p.g + local;
    let n = min(visible[t], p.d);
    let run = (n + WG - 1u) / WG;
    let lo = min(lid * run, n);
    let hi = min(lo + run, n);
    let row = local * p.d;
    let kk = min(p.e, n);
    // The largest threshold with at least kk scores at or above it: the kk-th largest.
    var thr = 0u;
    if (kk > 0u) {
        for (var bit = 31i; bit >= 0i; bit--) {
            let cand = thr | (1u << u32(bit));
            var c = 0u;
            for (var s = lo; s < hi; s++) {
                c += u32(order_key(scores[row + s]) >= cand);
            }
            if (wg_total(c, lid) >= kk) {
                thr = cand;
            }
        }
    }
    var above = 0u;
    var level = 0u;
    for (var s = lo; s < hi; s++) {
        let key = order_key(scores[row + s]);
        above += u32(key > thr);
        level += u32(key == thr);
    }
    let a = wg_before(above, lid);
    let l = wg_before(level, lid);
    // Ties at the threshold fill what is left, lowest entries first.
    let ties = kk - min(a.y, kk);
    let my_ties = min(level, ties - min(l.x, ties));
    var at = t * p.e + a.x + min(l.x, ties);
    var taken = 0u;
    for (var s = lo; s < hi; s++) {
        let key = order_key(scores[row + s]);
        var take = key > thr;
        if (key == thr && taken < my_ties) {
            take = true;
            taken++;
        }
        if (take && kk > 0u) {
            picks[at] = s;
            at++;
        }
    }
    for (var j = kk + lid; j < p.e; j += WG) {
        picks[t * p.e + j] = NO_ENTRY;
    }
}
#endif
