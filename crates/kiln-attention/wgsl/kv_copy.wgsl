// Copy whole blocks within one pool (copy-on-write after a fork): for each (src, dst) pair,
// `words` 32-bit words of block src go to block dst. One thread per word.

struct Params {
    pairs: u32,
    words: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> pairs: array<u32>;
@group(0) @binding(2) var<storage, read_write> pool: array<u32>;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let e = (wid.x + wid.y * nwg.x) * 64u + lid;
    if (e >= p.pairs * p.words) {
        return;
    }
    let i = e / p.words;
    let w = e % p.words;
    pool[pairs[2u * i + 1u] * p.words + w] = pool[pairs[2u * i] * p.words + w];
}
