// Y[i, n_offset + r] = sum_c X[i, c] * W[r, c] (+ bias), tiled for many rows of X (prefill,
// batched decode). A workgroup of 256 threads computes a BM x 64 tile of Y, BM (16, 32 or 64)
// sized to the rows of X so a small batch wastes little: thread (ty, tx) computes rows
// ty·TM .. ty·TM + TM - 1 (TM = BM / 16) at columns 4tx .. 4tx + 3, one vec4 accumulator a
// row. Each 16-wide slice of k is staged in workgroup memory: X as read, and W decoded once,
// eight elements a unit (`w_unit8`), into quads of columns, so the inner loop reads one vec4
// of W and TM values of X for 4·TM multiply-adds. Every element of W is read from memory
// once per BM rows of X.
// SPLIT (split-K, for products with too few tiles to fill a GPU: batched decode through a
// narrow projection) gives each tile `splits` workgroups, each summing kc of k, and writes
// their partial products to y as [splits][m][rows]; `matmul_split_sum.wgsl` adds them up (and
// the bias).

struct Params {
    m: u32,
    k: u32,
    rows: u32,
    n_total: u32,
    n_offset: u32,
    qs: u32,
    // SPLIT: workgroups a tile, and the length of k each sums (a multiple of KS).
    splits: u32,
    kc: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
#if BIAS
@group(0) @binding(4) var<storage, read> bias: array<f32>;
#endif

const BM: u32 = {{BM}}u;
const TM: u32 = BM / 16u;
const BN: u32 = 64u;
const KS: u32 = 16u;

// [KS][BM]: X's slice, one k a row.
var<workgroup> xs: array<f32, 1024>;
// [KS][BN / 4]: W's slice, decoded, four columns a vec4.
var<workgroup> ws: array<vec4<f32>, 256>;

@compute @workgroup_size(256)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    var g = wid.x + wid.y * nwg.x;
#if SPLIT
    let split = g % p.splits;
    g /= p.splits;
    let k_begin = split * p.kc;
    let k_end = min(p.k, k_begin + p.kc);
#else
    let k_begin = 0u;
    let k_end = p.k;
#endif
    let tiles_n = (p.rows + BN - 1u) / BN;
    let m0 = (g / tiles_n) * BM;
    let n0 = (g % tiles_n) * BN;
    if (m0 >= p.m) {
        return;
    }
    let tx = lid % 16u;
    let ty = lid / 16u;
    // One vec4 a row, in registers (no dynamically indexed array, which compilers for
    // CPU-type adapters would spill to memory); the rows past TM fold away.
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    for (var k0 = k_begin; k0 < k_end; k0 += KS) {
        for (var e = lid; e < BM * KS; e += 256u) {
            let r = e / KS;
            let c = e % KS;
            var v = 0.0;
            if (m0 + r < p.m && k0 + c < p.k) {
                v = x[(m0 + r) * p.k + k0 + c];
            }
            xs[c * BM + r] = v;
        }
        // 64 rows of W, two units of eight each.
        if (lid < 2u * BN) {
            let r = lid / 2u;
            let h = lid % 2u;
            var wv = W8(vec4<f32>(0.0), vec4<f32>(0.0));
            if (n0 + r < p.rows && k0 + 8u * h < p.k) {
                wv = w_unit8(n0 + r, k0 / 8u + h, p.k, p.qs);
            }
            let at = 8u * h * (BN / 4u) + r / 4u;
            let comp = r % 4u;
            for (var j = 0u; j < 4u; j++) {
                ws[at + j * (BN / 4u)][comp] = wv.a[j];
                ws[at + (j + 4u) * (BN / 4u)][comp] = wv.b[j];
            }
        }
        workgroupBarrier();
        for (var kk = 0u; kk < KS; kk++) {
            let b = ws[kk * (BN / 4u) + tx];
            let xb = kk * BM + ty * TM;
            acc0 += xs[xb] * b;
            if (TM > 1u) {
                acc1 += xs[xb + 1u] * b;
            }
            if (TM > 2u) {
                acc2 += xs[xb + 2u] * b;
                acc3 += xs[xb + 3u] * b;
            }
        }
        workgroupBarrier();
    }
    let accs = array<vec4<f32>, 4>(acc0, acc1, acc2, acc3);
    for (var i = 0u; i < TM; i++) {
        let gm = m0 + ty * TM + i;
        let row = accs[i];
        for (var j = 0u; j < 4u; j++) {
            let gn = n0 + tx * 4u + j;
            if (gm < p.m && gn < p.rows) {
#if SPLIT
                y[(split * p.m + gm) * p.rows + gn] = row[j];
#else
                var s = row[j];
#if BIAS
                s += bias[p.n_offset + gn];
#endif
                y[gm * p.n_total + p.n_offset + gn] = s;
#endif
            }
        }
    }
}
