// Mixture-of-experts routing and combining.
//
// ROUTE (`moe_route`, one workgroup): each token's TOPK experts by falling logit (ties to the
// lower index), each pick the largest logit below the previous one in that order, as the CPU
// reference picks them; their weights by p.mode (0: softmax over all experts; 1: the same,
// divided by the picks' sum; 2: softmax over the picks). Then the slots (token * TOPK + j)
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
}

@group(0) @binding(0) var<uniform> p: Params;

const EXPERTS: u32 = {{EXPERTS}}u;
const TOPK: u32 = {{TOPK}}u;

#if ROUTE
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> ids: array<u32>;
@group(0) @binding(3) var<storage, read_write> wts: array<f32>;
@group(0) @binding(4) var<storage, read_write> groups: array<u32>;

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
            for (var e = 0u; e < EXPERTS; e++) {
                let x = logits[row + e];
                let below = j == 0u || x < pv || (x == pv && e > pe);
                if (below && (!found || x > bv)) {
                    found = true;
                    bv = x;
                    be = e;
                }
            }
            ids[t * TOPK + j] = be;
            v[j] = bv;
            pv = bv;
            pe = be;
            atomicAdd(&counts[be], 1u);
        }
        let top = v[0];
        var total = 0.0;
        if (p.mode == 2u) {
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
            v[j] = exp(v[j] - top) / total;
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
