// Workgroup-wide reductions for workgroups of RED_WG invocations (a power of two, at most
// 256). Every invocation must call them (they contain barriers) and every invocation gets the
// result. With SUBGROUPS each subgroup reduces in registers and claims a slot through an
// atomic counter, so nothing assumes how invocations map onto subgroups or how large
// subgroups are.

const RED_WG: u32 = {{RED_WG}}u;

var<workgroup> red_buf: array<f32, RED_WG>;
var<workgroup> red_idx: array<u32, RED_WG>;
var<workgroup> red_buf4: array<vec4<f32>, RED_WG>;

#if SUBGROUPS
var<workgroup> red_slots: atomic<u32>;

fn red_begin(lid: u32) {
    if (lid == 0u) {
        atomicStore(&red_slots, 0u);
    }
    workgroupBarrier();
}

fn wg_sum(v: f32, lid: u32, sg_lane: u32) -> f32 {
    red_begin(lid);
    let s = subgroupAdd(v);
    if (sg_lane == 0u) {
        red_buf[atomicAdd(&red_slots, 1u)] = s;
    }
    workgroupBarrier();
    let n = atomicLoad(&red_slots);
    var t = 0.0;
    for (var i = 0u; i < n; i++) {
        t += red_buf[i];
    }
    workgroupBarrier();
    return t;
}

fn wg_sum4(v: vec4<f32>, lid: u32, sg_lane: u32) -> vec4<f32> {
    red_begin(lid);
    let s = subgroupAdd(v);
    if (sg_lane == 0u) {
        red_buf4[atomicAdd(&red_slots, 1u)] = s;
    }
    workgroupBarrier();
    let n = atomicLoad(&red_slots);
    var t = vec4<f32>(0.0);
    for (var i = 0u; i < n; i++) {
        t += red_buf4[i];
    }
    workgroupBarrier();
    return t;
}

fn wg_max(v: f32, lid: u32, sg_lane: u32) -> f32 {
    red_begin(lid);
    let s = subgroupMax(v);
    if (sg_lane == 0u) {
        red_buf[atomicAdd(&red_slots, 1u)] = s;
    }
    workgroupBarrier();
    let n = atomicLoad(&red_slots);
    var t = red_buf[0];
    for (var i = 1u; i < n; i++) {
        t = max(t, red_buf[i]);
    }
    workgroupBarrier();
    return t;
}

// The largest value and, among equal values, the smallest index.
fn wg_argmax(v: f32, idx: u32, lid: u32, sg_lane: u32) -> u32 {
    red_begin(lid);
    let m = subgroupMax(v);
    let i = subgroupMin(select(0xffffffffu, idx, v == m));
    if (sg_lane == 0u) {
        let s = atomicAdd(&red_slots, 1u);
        red_buf[s] = m;
        red_idx[s] = i;
    }
    workgroupBarrier();
    let n = atomicLoad(&red_slots);
    var bv = red_buf[0];
    var bi = red_idx[0];
    for (var j = 1u; j < n; j++) {
        if (red_buf[j] > bv || (red_buf[j] == bv && red_idx[j] < bi)) {
            bv = red_buf[j];
            bi = red_idx[j];
        }
    }
    workgroupBarrier();
    return bi;
}
#else
fn wg_sum(v: f32, lid: u32, sg_lane: u32) -> f32 {
    red_buf[lid] = v;
    workgroupBarrier();
    for (var s = RED_WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            red_buf[lid] += red_buf[lid + s];
        }
        workgroupBarrier();
    }
    let t = red_buf[0];
    workgroupBarrier();
    return t;
}

fn wg_sum4(v: vec4<f32>, lid: u32, sg_lane: u32) -> vec4<f32> {
    red_buf4[lid] = v;
    workgroupBarrier();
    for (var s = RED_WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            red_buf4[lid] += red_buf4[lid + s];
        }
        workgroupBarrier();
    }
    let t = red_buf4[0];
    workgroupBarrier();
    return t;
}

fn wg_max(v: f32, lid: u32, sg_lane: u32) -> f32 {
    red_buf[lid] = v;
    workgroupBarrier();
    for (var s = RED_WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            red_buf[lid] = max(red_buf[lid], red_buf[lid + s]);
        }
        workgroupBarrier();
    }
    let t = red_buf[0];
    workgroupBarrier();
    return t;
}

fn wg_argmax(v: f32, idx: u32, lid: u32, sg_lane: u32) -> u32 {
    red_buf[lid] = v;
    red_idx[lid] = idx;
    workgroupBarrier();
    for (var s = RED_WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            let ov = red_buf[lid + s];
            let oi = red_idx[lid + s];
            if (ov > red_buf[lid] || (ov == red_buf[lid] && oi < red_idx[lid])) {
                red_buf[lid] = ov;
                red_idx[lid] = oi;
            }
        }
        workgroupBarrier();
    }
    let t = red_idx[0];
    workgroupBarrier();
    return t;
}
#endif
