// DeepSeek-V4's attention core, one sequence: one 64-invocation workgroup per (token, head).
// The query reads one K=V head: the raw rows of positions max(first, p - window + 1) ..= p,
// each at row j - first, or through the raw pool's block table when raw_block is not 0
// (table[j / raw_block] · raw_block + j % raw_block); entries likewise through theirs;
// then the compressed entries it uses (every e < (p + 1) / ratio when `picks` is 0, else the
// token's `picks` picks, NO_ENTRY skipped). The head's sink joins the softmax as one more
// logit with no value. Online softmax: each key's score is one workgroup-wide dot product;
// each invocation keeps the running output of its channels (c = lid, lid + 64, ...).

struct Params {
    tokens: u32,
    heads: u32,
    dim: u32,
    first: u32,
    window: u32,
    entries: u32,
    picks: u32,
    ratio: u32,
    scale: f32,
    raw_block: u32,
    raw_table: u32,
    entry_block: u32,
    entry_table: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
// The positions (tokens of them), then the raw rows' block table, then the entries'.
@group(0) @binding(2) var<storage, read> index: array<u32>;
@group(0) @binding(3) var<storage, read> raw: array<f32>;
@group(0) @binding(4) var<storage, read> entries: array<f32>;
@group(0) @binding(5) var<storage, read> picks: array<u32>;
@group(0) @binding(6) var<storage, read> sinks: array<f32>;
@group(0) @binding(7) var<storage, read_write> out: array<f32>;

const WG: u32 = 64u;
// Channels an invocation keeps: head_dim up to 64 · CH.
const CH: u32 = 16u;
const NO_ENTRY: u32 = 0xffffffffu;

var<workgroup> partial: array<f32, WG>;

// The first value of position j's raw row.
fn raw_at(j: u32) -> u32 {
    if (p.raw_block == 0u) {
        return (j - p.first) * p.dim;
    }
    return (index[p.raw_table + j / p.raw_block] * p.raw_block + j % p.raw_block) * p.dim;
}

// The first value of entry e.
fn entry_at(e: u32) -> u32 {
    if (p.entry_block == 0u) {
        return e * p.dim;
    }
    return (index[p.entry_table + e / p.entry_block] * p.entry_block + e % p.entry_block) * p.dim;
}

var<private> acc: array<f32, CH>;
var<private> run_max: f32;
var<private> run_sum: f32;

fn wg_sum(v: f32, lid: u32) -> f32 {
    partial[lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            partial[lid] += partial[lid + s];
        }
        workgroupBarrier();
    }
    let total = partial[0];
    workgroupBarrier();
    return total;
}

// Fold in one key row (at `base` of `from_raw` ? raw : entries). Uniform per workgroup.
fn attend(qb: u32, base: u32, from_raw: bool, lid: u32) {
    var d = 0.0;
    for (var i = 0u; i < CH; i++) {
        let c = lid + i * WG;
        if (c < p.dim) {
            var k: f32;
            if (from_raw) {
                k = raw[base + c];
            } else {
                k = entries[base + c];
            }
            d += q[qb + c] * k;
        }
    }
    let s = wg_sum(d, lid) * p.scale;
    let m = max(run_max, s);
    let old = exp(run_max - m);
    let e = exp(s - m);
    run_sum = run_sum * old + e;
    for (var i = 0u; i < CH; i++) {
        let c = lid + i * WG;
        if (c < p.dim) {
            var v: f32;
            if (from_raw) {
                v = raw[base + c];
            } else {
                v = entries[base + c];
            }
            acc[i] = acc[i] * old + e * v;
        }
    }
    run_max = m;
}

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let g = wid.x + wid.y * nwg.x;
    // Uniform per workgroup, so the barriers below stay in uniform control flow.
    if (g >= p.tokens * p.heads) {
        return;
    }
    let t = g / p.heads;
    let h = g % p.heads;
    let qb = g * p.dim;
    let ps = index[t];
    // The sink starts the softmax: weight exp(sink - max), no value.
    run_max = sinks[h];
    run_sum = 1.0;
    for (var i = 0u; i < CH; i++) {
        acc[i] = 0.0;
    }
    var lo = p.first;
    if (ps + 1u > p.window + p.first) {
        lo = ps + 1u - p.window;
    }
    for (var j = lo; j <= ps; j++) {
        attend(qb, raw_at(j), true, lid);
    }
    if (p.picks == 0u) {
        let n = min((ps + 1u) / p.ratio, p.entries);
        for (var e = 0u; e < n; e++) {
            attend(qb, entry_at(e), false, lid);
        }
    } else {
        for (var i = 0u; i < p.picks; i++) {
            let e = picks[t * p.picks + i];
            if (e != NO_ENTRY && e < p.entries) {
                attend(qb, entry_at(e), false, lid);
            }
        }
    }
    for (var i = 0u; i < CH; i++) {
        let c = lid + i * WG;
        if (c < p.dim) {
            out[qb + c] = acc[i] / run_sum;
        }
    }
}
