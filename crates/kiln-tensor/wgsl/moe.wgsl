// Mixture-of-experts routing and combining.
//
// ROUTE (`moe_route`, one workgroup): each token's TOPK experts by falling score (ties to the
// lower index), each pick the largest score (plus bias[e] when p.bias) below the previous one
// in that order, as the CPU reference picks them, or the given ones (p.fixed); the score is
// the logit, or sqrt(softplus(logit)) in mode 3. Their weights by p.mode (0: softmax over all
// experts; 1: the same, divided by the picks' sum; 2: softmax over the picks; 3: the picks'
// scores divided by their sum plus 1e-20, times p.scale). Then the slots (token * TOPK + j)
// are grouped by expert: offsets[EXPERTS + 1], then the slot list (in any order within an
// expert: every slot's product is computed on its own).
//
// Otherwise (`moe_combine`): out[t, c] = res[t, c] + sum_j w[t, j] * y[t * TOPK + j, c], the
// terms in slot order; p.width is the row width.

struct Params {
    tokens: u32,
    experts: u32,
    k: u32,
    mode: u32,
    width: u32,
    bias: u32,
    fixed: u32,
    scale: f32,
}

@group(0) @binding(0) var<uniform> p: Params;

const EXPERTS: u32 = {{EXPERTS}}u;
const TOPK: u32 = {{TOPK}}u;

#if ROUTE
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read> sel_bias: array<f32>;
@group(0) @binding(3) var<storage, read> given: array<u32>;
@group(0) @binding(4) var<storage, read_write> ids: array<u32>;
@group(0) @binding(5) var<storage, read_write> wts: array<f32>;
@group(0) @binding(6) var<storage, read_write> groups: array<u32>;

// ln(1 + y) for y in [0, 1] without `log` (whose accuracy WGSL bounds only absolutely, too
// loosely near 1): 2·atanh(z), z = y / (2 + y) <= 1/3, to the z^15 term (error < 1e-9).
fn log1p_unit(y: f32) -> f32 {
    let z = y / (2.0 + y);
    let z2 = z * z;
    var s = 1.0 / 15.0;
    s = s * z2 + 1.0 / 13.0;
    s = s * z2 + 1.0 / 11.0;
    s = s * z2 + 1.0 / 9.0;
    s = s * z2 + 1.0 / 7.0;
    s = s * z2 + 1.0 / 5.0;
    s = s * z2 + 1.0 / 3.0;
    s = s * z2 + 1.0;
    return 2.0 * z * s;
}

// ln(1 + e^x) as torch computes it (x itself above 20): max(x, 0) + ln(1 + e^-|x|).
fn softplus(x: f32) -> f32 {
    if (x > 20.0) {
        return x;
    }
    return max(x, 0.0) + log1p_unit(exp(-abs(x)));
}

fn score(row: u32, e: u32) -> f32 {
    let l = logits[row + e];
    if (p.mode == 3u) {
        return sqrt(softplus(l));
    }
    return l;
}

fn select_value(row: u32, e: u32) -> f32 {
    var v = score(row, e);
    if (p.bias == 1u) {
        v += sel_bias[e];
    }
    return v;
}

var<workgroup> counts: array<atomic<u32>, EXPERTS>;
var<workgroup> offsets: array<u32, EXPERTS>;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) lid: u32) {
    for (var e = lid; e < EXPERTS; e += 64u) {
        atomicStore(&counts[e], 0u);
    }
    workgroupBarrier();
    for (var t = lid; t < p.tokens; t += 64u) {
        let row = t * EXPERTS;
        var pv = 0.0;
        var pe = 0u;
        var v: array<f32, TOPK>;
        for (var j = 0u; j < TOPK; j++) {
            var found = false;
            var bv = 0.0;
            var be = 0u;
            if (p.fixed == 1u) {
                be = given[t * TOPK + j];
            } else {
                for (var e = 0u; e < EXPERTS; e++) {
                    let x = select_value(row, e);
                    let below = j == 0u || x < pv || (x == pv && e > pe);
                    if (below && (!found || x > bv)) {
                        found = true;
                        bv = x;
                        be = e;
                    }
                }
            }
            ids[t * TOPK + j] = be;
            v[j] = score(row, be);
            pv = bv;
            pe = be;
            atomicAdd(&counts[be], 1u);
        }
        let top = v[0];
        var total = 0.0;
        if (p.mode == 3u) {
            for (var j = 0u; j < TOPK; j++) {
                total += v[j];
            }
            total += 1e-20;
        } else if (p.mode == 2u) {
            for (var j = 0u; j < TOPK; j++) {
                total += exp(v[j] - top);
            }
        } else {
            for (var e = 0u; e < EXPERTS; e++) {
                total += exp(logits[row + e] - top);
            }
        }
        var picked = 0.0;
        for (var j = 0u; j < TOPK; j++) {
            if (p.mode == 3u) {
                v[j] = v[j] / total * p.scale;
            } else {
                v[j] = exp(v[j] - top) / total;
            }
            picked += v[j];
        }
        for (var j = 0u; j < TOPK; j++) {
            var w = v[j];
            if (p.mode == 1u) {
                w = w / picked;
            }
            wts[t * TOPK + j] = w;
        }
    }
    workgroupBarrier();
    if (lid == 0u) {
        var at = 0u;
        for (var e = 0u; e < EXPERTS; e++) {
            groups[e] = at;
            offsets[e] = at;
            at += atomicLoad(&counts[e]);
            atomicStore(&counts[e], 0u);
        }
        groups[EXPERTS] = at;
    }
    // The ids other invocations wrote, and the offsets.
    storageBarrier();
    workgroupBarrier();
    for (var s = lid; s < p.tokens * TOPK; s += 64u) {
        let e = ids[s];
        let at = offsets[e] + atomicAdd(&counts[e], 1u);
        groups[EXPERTS + 1u + at] = s;
    }
}
#else
@group(0) @binding(1) var<storage, read> y: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read> res: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let i = (wid.x + wid.y * nwg.x) * 64u + lid;
    let n = p.width;
    if (i >= p.tokens * n) {
        return;
    }
    let t = i / n;
    let c = i % n;
    var s = 0.0;
    for (var j = 0u; j < TOPK; j++) {
        s += w[t * TOPK + j] * y[(t * TOPK + j) * n + c];
    }
    out[i] = res[i] + s;
}
#endif
