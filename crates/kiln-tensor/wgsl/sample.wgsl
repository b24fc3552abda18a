// sample: one token per row of logits, one workgroup (RED_WG invocations) a row; ops/sample.rs says what each
// step means and holds the CPU reference. The row is copied into `work` sanitized and masked,
// the row's edits applied there, then:
// - greedy: the first index of the largest value;
// - otherwise: top-k and top-p as thresholds on an order-preserving integer key of the value,
//   each found four bits a pass (8 passes over the row, each a 16-bin histogram of counts or
//   mass per invocation, reduced), ties at a threshold kept by lowest id (a bit-by-bit search
//   over ids, only when there are more ties than places); min-p; then the Gumbel-max draw,
//   argmax of (v − max) / T + G(seed, draw, id).
// Loops that hold a barrier run a fixed number of times or under workgroupUniformLoad'ed
// conditions, so control flow around barriers is uniform.

struct Params {
    n: u32,
    vocab: u32,
    id_bits: u32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
// Per row a header of 12 words (row, temperature, top_k, top_p, min_p, seed lo/hi,
// draw lo/hi, first edit word, edits, first mask word or NONE), then edits and masks.
@group(0) @binding(2) var<storage, read> info: array<u32>;
@group(0) @binding(3) var<storage, read_write> work: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<u32>;

const NEG_INF: u32 = 0xff800000u;
// okey(-inf): a value is a candidate when its key is larger.
const NEG_KEY: u32 = 0x007fffffu;
const NONE: u32 = 0xffffffffu;

var<workgroup> uni: u32;

fn neg_inf() -> f32 {
    return bitcast<f32>(NEG_INF);
}

// NaN → -inf, +inf → f32::MAX, by bits (some compilers assume arithmetic never meets them).
fn sanitize(v: f32) -> f32 {
    let b = bitcast<u32>(v);
    if ((b & 0x7fffffffu) > 0x7f800000u) {
        return neg_inf();
    }
    if (b == 0x7f800000u) {
        return bitcast<f32>(0x7f7fffffu);
    }
    return v;
}

// a < b as floats exactly when okey(a) < okey(b) (NaN aside).
fn okey(v: f32) -> u32 {
    let b = bitcast<u32>(v);
    return select(b | 0x80000000u, ~b, (b & 0x80000000u) != 0u);
}

fn from_key(k: u32) -> f32 {
    return bitcast<f32>(select(~k, k & 0x7fffffffu, (k & 0x80000000u) != 0u));
}

// A value all invocations hold, as a workgroup-uniform one for control flow.
fn uniform_u32(v: u32, lid: u32) -> u32 {
    if (lid == 0u) {
        uni = v;
    }
    return workgroupUniformLoad(&uni);
}

// Kept by a threshold (tk, ti): a larger key, or the same key and an id up to ti.
fn above(k: u32, i: u32, tk: u32, ti: u32) -> bool {
    return k > tk || (k == tk && i <= ti);
}

// 64-bit arithmetic on (lo, hi) pairs, for splitmix64's finaliser as the CPU computes it.
fn mul_wide(x: u32, y: u32) -> vec2<u32> {
    let x0 = x & 0xffffu;
    let x1 = x >> 16u;
    let y0 = y & 0xffffu;
    let y1 = y >> 16u;
    let p00 = x0 * y0;
    let p01 = x0 * y1;
    let p10 = x1 * y0;
    let p11 = x1 * y1;
    let mid = (p00 >> 16u) + (p01 & 0xffffu) + (p10 & 0xffffu);
    return vec2<u32>((p00 & 0xffffu) | (mid << 16u), p11 + (p01 >> 16u) + (p10 >> 16u) + (mid >> 16u));
}

fn mul64(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
    let w = mul_wide(a.x, b.x);
    return vec2<u32>(w.x, w.y + a.x * b.y + a.y * b.x);
}

fn add64(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
    let lo = a.x + b.x;
    return vec2<u32>(lo, a.y + b.y + select(0u, 1u, lo < a.x));
}

// z ^ (z >> s) for 0 < s < 32.
fn xor_shr(z: vec2<u32>, s: u32) -> vec2<u32> {
    return vec2<u32>(z.x ^ ((z.x >> s) | (z.y << (32u - s))), z.y ^ (z.y >> s));
}

fn mix(z0: vec2<u32>) -> vec2<u32> {
    var z = add64(z0, vec2<u32>(0x7f4a7c15u, 0x9e3779b9u));
    z = mul64(xor_shr(z, 30u), vec2<u32>(0x1ce4e5b9u, 0xbf58476du));
    z = mul64(xor_shr(z, 27u), vec2<u32>(0x133111ebu, 0x94d049bbu));
    return xor_shr(z, 31u);
}

// Standard Gumbel noise for token `id` in `draw` of `seed`: the CPU's hash, its top 23 bits
// as a uniform centred in its cell (never 0 or 1 in f32).
fn gumbel(seed: vec2<u32>, draw: vec2<u32>, id: u32) -> f32 {
    let bits = mix(seed ^ mix(draw ^ mix(vec2<u32>(id, 0u))));
    let u = (f32(bits.y >> 9u) + 0.5) * (1.0 / 8388608.0);
    return -log(-log(u));
}

// 16 bins of a histogram, per invocation.
struct Bins {
    b0: vec4<f32>,
    b1: vec4<f32>,
    b2: vec4<f32>,
    b3: vec4<f32>,
}

fn bin_add(h: ptr<function, Bins>, q: u32, w: f32) {
    let qv = vec4<u32>(q);
    let z = vec4<f32>(0.0);
    let wv = vec4<f32>(w);
    (*h).b0 += select(z, wv, qv == vec4<u32>(0u, 1u, 2u, 3u));
    (*h).b1 += select(z, wv, qv == vec4<u32>(4u, 5u, 6u, 7u));
    (*h).b2 += select(z, wv, qv == vec4<u32>(8u, 9u, 10u, 11u));
    (*h).b3 += select(z, wv, qv == vec4<u32>(12u, 13u, 14u, 15u));
}

// The largest key t such that the candidates (tk, ti) keeps with key >= t number (or, under
// `mass`, weigh) at least `goal`, given that all of them do: four bits a pass, from the top.
fn search(dst: u32, goal: f32, mass: bool, tk: u32, ti: u32, m: f32, temp: f32, lid: u32, lane: u32) -> u32 {
    var t = 0u;
    for (var nibble = 0u; nibble < 8u; nibble++) {
        let s = 28u - 4u * nibble;
        var h = Bins(vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0));
        for (var i = lid; i < p.vocab; i += RED_WG) {
            let v = work[dst + i];
            let k = okey(v);
            if (k > NEG_KEY && k >= t && above(k, i, tk, ti)) {
                // Keys past this pass's 16 steps count in every bin's suffix.
                let q = min((k - t) >> s, 15u);
                bin_add(&h, q, select(1.0, exp((v - m) / temp), mass));
            }
        }
        let b0 = wg_sum4(h.b0, lid, lane);
        let b1 = wg_sum4(h.b1, lid, lane);
        let b2 = wg_sum4(h.b2, lid, lane);
        let b3 = wg_sum4(h.b3, lid, lane);
        let bins = array<f32, 16>(b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w,
            b2.x, b2.y, b2.z, b2.w, b3.x, b3.y, b3.z, b3.w);
        // Suffix sums from the top: the largest digit whose keys reach the goal.
        var acc = 0.0;
        var digit = 0u;
        for (var j = 15u; j > 0u; j--) {
            acc += bins[j];
            if (digit == 0u && acc >= goal) {
                digit = j;
            }
        }
        t = t | (digit << s);
    }
    return t;
}

// The id of the `need`-th candidate, in id order, with key t that (tk, ti) keeps: the largest
// c0 with fewer than `need` such ids below it.
fn tie_cut(dst: u32, t: u32, need: f32, tk: u32, ti: u32, lid: u32, lane: u32) -> u32 {
    var c0 = 0u;
    for (var bit = p.id_bits; bit > 0u; bit--) {
        let c = c0 | (1u << (bit - 1u));
        let end = min(c, p.vocab);
        var cnt = 0.0;
        for (var i = lid; i < end; i += RED_WG) {
            let k = okey(work[dst + i]);
            if (k == t && above(k, i, tk, ti)) {
                cnt += 1.0;
            }
        }
        if (wg_sum(cnt, lid, lane) < need) {
            c0 = c;
        }
    }
    return c0;
}

@compute @workgroup_size(RED_WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    {{SG_ARG}}
) {
    let s = wid.x + wid.y * nwg.x;
    if (s >= p.n) {
        return;
    }
    let lane = {{SG_LANE}};
    let h = s * 12u;
    let temp = bitcast<f32>(info[h + 1u]);
    let top_k = info[h + 2u];
    let top_p = bitcast<f32>(info[h + 3u]);
    let min_p = bitcast<f32>(info[h + 4u]);
    let seed = vec2<u32>(info[h + 5u], info[h + 6u]);
    let draw = vec2<u32>(info[h + 7u], info[h + 8u]);
    let e0 = info[h + 9u];
    let ne = info[h + 10u];
    let mask0 = info[h + 11u];
    let vocab = p.vocab;
    let src = info[h] * vocab;
    let dst = s * vocab;

    // The row, sanitized and masked.
    for (var i = lid; i < vocab; i += RED_WG) {
        var v = sanitize(logits[src + i]);
        if (mask0 != NONE && ((info[mask0 + i / 32u] >> (i % 32u)) & 1u) == 0u) {
            v = neg_inf();
        }
        work[dst + i] = v;
    }
    storageBarrier();
    // The edits (distinct ids).
    for (var e = lid; e < ne; e += RED_WG) {
        let at = e0 + 4u * e;
        let id = info[at];
        let add = info[at + 1u];
        let rep = bitcast<f32>(info[at + 2u]);
        var v = work[dst + id];
        if (add == NEG_INF || bitcast<u32>(v) == NEG_INF) {
            v = neg_inf();
        } else {
            v += bitcast<f32>(add);
            if (rep != 1.0) {
                v = select(v * rep, v / rep, v > 0.0);
            }
            v = sanitize(v - bitcast<f32>(info[at + 3u]));
        }
        work[dst + id] = v;
    }
    storageBarrier();

    // The best value (first index on ties) and the candidates' count.
    var bv = neg_inf();
    var bi = NONE;
    var n = 0.0;
    for (var i = lid; i < vocab; i += RED_WG) {
        let v = work[dst + i];
        if (okey(v) > NEG_KEY) {
            n += 1.0;
            if (bi == NONE || v > bv) {
                bv = v;
                bi = i;
            }
        }
    }
    let best = wg_argmax(bv, bi, lid, lane);
    let n_cand = wg_sum(n, lid, lane);
    let greedy = temp == 0.0 || top_k == 1u;
    if (uniform_u32(u32(greedy || best == NONE), lid) == 1u) {
        if (lid == 0u) {
            out[s] = best;
        }
        return;
    }
    let m = work[dst + best];

    // Top-k: the k-th largest key, and the lowest ids among its ties.
    var k_key = 0u;
    var k_id = NONE;
    let kf = f32(top_k);
    if (uniform_u32(u32(top_k > 0u && kf < n_cand), lid) == 1u) {
        let t = search(dst, kf, false, 0u, NONE, m, temp, lid, lane);
        var gt = 0.0;
        var eq = 0.0;
        for (var i = lid; i < vocab; i += RED_WG) {
            let k = okey(work[dst + i]);
            gt += select(0.0, 1.0, k > t);
            eq += select(0.0, 1.0, k == t);
        }
        let need = kf - wg_sum(gt, lid, lane);
        let ties = wg_sum(eq, lid, lane);
        k_key = t;
        if (uniform_u32(u32(need < ties), lid) == 1u) {
            k_id = tie_cut(dst, t, need, 0u, NONE, lid, lane);
        }
    }

    // Top-p over what top-k kept: the shortest prefix, best first, holding top_p of the mass.
    var p_key = 0u;
    var p_id = NONE;
    if (uniform_u32(u32(top_p < 1.0), lid) == 1u) {
        var tot = 0.0;
        for (var i = lid; i < vocab; i += RED_WG) {
            let v = work[dst + i];
            let k = okey(v);
            if (k > NEG_KEY && above(k, i, k_key, k_id)) {
                tot += exp((v - m) / temp);
            }
        }
        let goal = top_p * wg_sum(tot, lid, lane);
        let t = search(dst, goal, true, k_key, k_id, m, temp, lid, lane);
        var gt = 0.0;
        var eq = 0.0;
        for (var i = lid; i < vocab; i += RED_WG) {
            let v = work[dst + i];
            let k = okey(v);
            if (k > NEG_KEY && above(k, i, k_key, k_id)) {
                if (k > t) {
                    gt += exp((v - m) / temp);
                } else if (k == t) {
                    eq += 1.0;
                }
            }
        }
        let mass_gt = wg_sum(gt, lid, lane);
        let ties = wg_sum(eq, lid, lane);
        let wt = exp((from_key(t) - m) / temp);
        let need = clamp(ceil((goal - mass_gt) / wt), 1.0, ties);
        p_key = t;
        if (uniform_u32(u32(need < ties), lid) == 1u) {
            p_id = tie_cut(dst, t, need, k_key, k_id, lid, lane);
        }
    }

    // Min-p, then the draw.
    var bs = neg_inf();
    var bsi = NONE;
    for (var i = lid; i < vocab; i += RED_WG) {
        let v = work[dst + i];
        let k = okey(v);
        if (k > NEG_KEY && above(k, i, k_key, k_id) && above(k, i, p_key, p_id)) {
            let x = (v - m) / temp;
            if (min_p <= 0.0 || exp(x) >= min_p) {
                let sc = x + gumbel(seed, draw, i);
                if (bsi == NONE || sc > bs) {
                    bs = sc;
                    bsi = i;
                }
            }
        }
    }
    let picked = wg_argmax(bs, bsi, lid, lane);
    if (lid == 0u) {
        out[s] = picked;
    }
}
