// Rotary position embedding of x [tokens, heads, head_dim] at per-token positions, from a
// [max_pos, rot / 2, 2] table of (cos, sin). Channels first .. first + rot of each head are
// turned (by minus the angle when `back`); the others pass through.
// Half-split ("neox", HF): pairs (j, j + rot/2). Interleaved (GGUF llama): pairs (2j, 2j + 1).
// A position past the table leaves its token unrotated (callers validate positions).

struct Params {
    tokens: u32,
    heads: u32,
    head_dim: u32,
    rot: u32,
    max_pos: u32,
    interleaved: u32,
    first: u32,
    back: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> pos: array<u32>;
@group(0) @binding(3) var<storage, read> cs: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let e = (wid.x + wid.y * nwg.x) * 64u + lid;
    if (e >= p.tokens * p.heads * p.head_dim) {
        return;
    }
    let c = e % p.head_dim;
    let t = e / (p.heads * p.head_dim);
    let ps = pos[t];
    let v = x[e];
    // (Wraps below `first`, where it is not read.)
    let d = c - p.first;
    if (c < p.first || d >= p.rot || ps >= p.max_pos) {
        out[e] = v;
        return;
    }
    let half = p.rot / 2u;
    var j: u32;
    var other: f32;
    var sign: f32;
    if (p.interleaved == 1u) {
        j = d / 2u;
        if (d % 2u == 0u) {
            other = x[e + 1u];
            sign = -1.0;
        } else {
            other = x[e - 1u];
            sign = 1.0;
        }
    } else {
        if (d < half) {
            j = d;
            other = x[e + half];
            sign = -1.0;
        } else {
            j = d - half;
            other = x[e - half];
            sign = 1.0;
        }
    }
    if (p.back == 1u) {
        sign = -sign;
    }
    let at = (ps * half + j) * 2u;
    out[e] = v * cs[at] + sign * other * cs[at + 1u];
}
