// out[t, c] = table[ids[t], c] for the rows of the table held by this chunk. The launch for the
// first chunk also writes zeros for ids past the end of the whole table.
//
// Under COLS, `gather_cols`: out[r, i] = x[r, ids[i]], x bound as an F32 table of p.rows rows
// of p.k, the ids its p.n_ids column indices (checked against p.k on the host).

struct Params {
    n_ids: u32,
    k: u32,
    row0: u32,
    rows: u32,
    total_rows: u32,
    qs: u32,
    first: u32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let e = (wid.x + wid.y * nwg.x) * 64u + lid;
#if COLS
    if (e < p.rows * p.n_ids) {
        out[e] = w_at(e / p.n_ids, ids[e % p.n_ids], p.k, p.qs);
    }
#else
    if (e >= p.n_ids * p.k) {
        return;
    }
    let t = e / p.k;
    let c = e % p.k;
    let id = ids[t];
    if (id >= p.row0 && id < p.row0 + p.rows) {
        out[e] = w_at(id - p.row0, c, p.k, p.qs);
    } else if (p.first == 1u && id >= p.total_rows) {
        out[e] = 0.0;
    }
#endif
}
