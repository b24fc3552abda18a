// Y[i, n_offset + r] = sum_c X[i, c] * W[r, c] (+ bias) on cooperative matrices (tensor
// cores): the tiled kernel's job (prefill, batched decode) where the adapter multiplies
// 16 x 16 f16 tiles into f32 (`--kernels experimental` only). A workgroup is one subgroup
// (SG invocations, the adapter's one subgroup size) and computes a 32 x 32 tile of Y as four
// 16 x 16 accumulators. Each 32-wide slice of k is staged in workgroup memory as f16: X's rows
// as read, W decoded once, eight elements a unit (`w_unit8`). A is X's 16 x 16 block (row
// major), B is Wᵀ's (W's rows are B's columns: column major). The accumulators go through
// workgroup memory to Y, so partial tiles at the edges and the bias need no second path.
// The including launcher puts `enable wgpu_cooperative_matrix;` first and requires F16.
// Before the first GPU run: naga 30 writes the module under the Vulkan memory model but its
// barriers without MakeAvailable/MakeVisible (wgpu issue 8805); if tiles come out stale on a
// GPU, the hand-offs through workgroup memory (staging to loads, stores to the copy) are the
// first suspects.

struct Params {
    m: u32,
    k: u32,
    rows: u32,
    n_total: u32,
    n_offset: u32,
    qs: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
#if BIAS
@group(0) @binding(4) var<storage, read> bias: array<f32>;
#endif

const SG: u32 = {{SG}}u;
const BM: u32 = 32u;
const BN: u32 = 32u;
const KS: u32 = 32u;

// [BM][KS]: X's slice, row major.
var<workgroup> xs: array<f16, 1024>;
// [BN][KS]: W's slice, decoded, one row of W a row.
var<workgroup> ws: array<f16, 1024>;
// [BM][BN]: the tile of Y.
var<workgroup> ys: array<f32, 1024>;

@compute @workgroup_size(SG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let g = wid.x + wid.y * nwg.x;
    let tiles_n = (p.rows + BN - 1u) / BN;
    let m0 = (g / tiles_n) * BM;
    let n0 = (g % tiles_n) * BN;
    // Uniform over the workgroup (one subgroup), as the cooperative operations need.
    if (m0 >= p.m) {
        return;
    }
    // The accumulators start as loads of a zeroed tile rather than as constant zeros (an
    // OpConstantNull of a cooperative matrix type, which Vulkan's conformance tests do not
    // cover and one driver has mishandled).
    for (var e = lid; e < BM * BN; e += SG) {
        ys[e] = 0.0;
    }
    workgroupBarrier();
    var c00 = coopLoadT<coop_mat16x16<f32, C>>(&ys[0u], BN);
    var c01 = coopLoadT<coop_mat16x16<f32, C>>(&ys[16u], BN);
    var c10 = coopLoadT<coop_mat16x16<f32, C>>(&ys[16u * BN], BN);
    var c11 = coopLoadT<coop_mat16x16<f32, C>>(&ys[16u * BN + 16u], BN);
    for (var k0 = 0u; k0 < p.k; k0 += KS) {
        for (var e = lid; e < BM * KS; e += SG) {
            let r = e / KS;
            let c = e % KS;
            var v = 0.0;
            if (m0 + r < p.m && k0 + c < p.k) {
                v = x[(m0 + r) * p.k + k0 + c];
            }
            xs[e] = f16(v);
        }
        // BN rows of W, KS / 8 units of eight each.
        for (var e = lid; e < BN * (KS / 8u); e += SG) {
            let r = e / (KS / 8u);
            let u = e % (KS / 8u);
            var wv = W8(vec4<f32>(0.0), vec4<f32>(0.0));
            if (n0 + r < p.rows && k0 + 8u * u < p.k) {
                wv = w_unit8(n0 + r, k0 / 8u + u, p.k, p.qs);
            }
            let at = r * KS + 8u * u;
            for (var j = 0u; j < 4u; j++) {
                ws[at + j] = f16(wv.a[j]);
                ws[at + 4u + j] = f16(wv.b[j]);
            }
        }
        workgroupBarrier();
        for (var kk = 0u; kk < KS; kk += 16u) {
            let a0 = coopLoadT<coop_mat16x16<f16, A>>(&xs[kk], KS);
            let a1 = coopLoadT<coop_mat16x16<f16, A>>(&xs[16u * KS + kk], KS);
            let b0 = coopLoad<coop_mat16x16<f16, B>>(&ws[kk], KS);
            let b1 = coopLoad<coop_mat16x16<f16, B>>(&ws[16u * KS + kk], KS);
            c00 = coopMultiplyAdd(a0, b0, c00);
            c01 = coopMultiplyAdd(a0, b1, c01);
            c10 = coopMultiplyAdd(a1, b0, c10);
            c11 = coopMultiplyAdd(a1, b1, c11);
        }
        workgroupBarrier();
    }
    coopStoreT(c00, &ys[0u], BN);
    coopStoreT(c01, &ys[16u], BN);
    coopStoreT(c10, &ys[16u * BN], BN);
    coopStoreT(c11, &ys[16u * BN + 16u], BN);
    workgroupBarrier();
    for (var e = lid; e < BM * BN; e += SG) {
        let gm = m0 + e / BN;
        let gn = n0 + e % BN;
        if (gm < p.m && gn < p.rows) {
            var s = ys[e];
#if BIAS
            s += bias[p.n_offset + gn];
#endif
            y[gm * p.n_total + p.n_offset + gn] = s;
        }
    }
}
