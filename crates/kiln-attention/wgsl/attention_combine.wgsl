// The second pass of split-key attention (paged_attention.wgsl with splits > 1): one
// 64-thread workgroup per (query token, query head) weighs its `splits` runs together. Run s
// left its normalized output o_s, its score maximum m_s and its sum l_s of exp(score - m_s);
// the output is sum_s w_s·o_s / sum_s w_s with w_s = l_s·exp(m_s - max_s m_s), over the runs
// with l_s > 0 (a run past the query's keys has none; the first run always has one).

struct Params {
    tokens: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    block_size: u32,
    window: u32,
    scale: f32,
    had_norm: f32,
    groups: u32,
    splits: u32,
    split_keys: u32,
    _pad0: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
// [tokens, heads, splits, head_dim + 2]
@group(0) @binding(1) var<storage, read> parts: array<f32>;
// [tokens, heads, head_dim]
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let g = wid.x + wid.y * nwg.x;
    if (g >= p.tokens * p.heads) {
        return;
    }
    let hd = p.head_dim;
    let stride = hd + 2u;
    let base = g * p.splits * stride;
    var mx = bitcast<f32>(0xff800000u);
    for (var s = 0u; s < p.splits; s++) {
        let row = base + s * stride;
        if (parts[row + hd + 1u] > 0.0) {
            mx = max(mx, parts[row + hd]);
        }
    }
    var total = 0.0;
    for (var s = 0u; s < p.splits; s++) {
        let row = base + s * stride;
        let l = parts[row + hd + 1u];
        if (l > 0.0) {
            total += l * exp(parts[row + hd] - mx);
        }
    }
    for (var d = lid; d < hd; d += 64u) {
        var a = 0.0;
        for (var s = 0u; s < p.splits; s++) {
            let row = base + s * stride;
            let l = parts[row + hd + 1u];
            if (l > 0.0) {
                a += l * exp(parts[row + hd] - mx) * parts[row + d];
            }
        }
        out[g * hd + d] = a / total;
    }
}
