// The INT4 cache's key centres (stored.rs `KeyCentre`): per (kv head, pair) four words,
// `lo | hi << 16` (the pair's channels), then the bits of freq, mean lo and mean hi. A key at
// position p is stored less R(p)·mean (RoPE's rotation of the pre-RoPE mean) and its scores
// get q·R(p)·mean back. Prepended to the kernels that write or read K/V.

const CENTRED_PAIRS: u32 = 8u;

// (cos, sin) of pos·freq: the angle rounded to f32 as RoPE rounds it, then reduced by whole
// turns (2π in two parts, the first exact in few bits) so that cos and sin see |r| <= π.
fn centre_cs(pos: u32, freq: f32) -> vec2<f32> {
    let a = f32(pos) * freq;
    let n = round(a * 0.15915494309189535);
    let r = (a - n * 6.28125) - n * 0.0019353071795864769;
    return vec2<f32>(cos(r), sin(r));
}

// R(pos)·mean of one centre: its values at (lo, hi).
fn centre_at(c: vec4<u32>, pos: u32) -> vec2<f32> {
    let cs = centre_cs(pos, bitcast<f32>(c.y));
    let a = bitcast<f32>(c.z);
    let b = bitcast<f32>(c.w);
    return vec2<f32>(a * cs.x - b * cs.y, b * cs.x + a * cs.y);
}

// A query's share of one centre (q_lo, q_hi: its channels lo and hi, unrotated):
// (A, B, freq) with q·R(p)·mean = A·cos(p·freq) + B·sin(p·freq).
fn centre_query(c: vec4<u32>, q_lo: f32, q_hi: f32) -> vec4<f32> {
    let a = bitcast<f32>(c.z);
    let b = bitcast<f32>(c.w);
    return vec4<f32>(q_lo * a + q_hi * b, q_hi * a - q_lo * b, bitcast<f32>(c.y), 0.0);
}

// What the centre gives back to the score of the key at `pos`.
fn centre_term(cq: vec4<f32>, pos: u32) -> f32 {
    let cs = centre_cs(pos, cq.z);
    return cq.x * cs.x + cq.y * cs.y;
}
