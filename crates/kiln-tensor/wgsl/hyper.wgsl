// Hyper-connections (DeepSeek-V4's mHC), n streams a token.
// WEIGHTS: one invocation per token: pre, post and comb from its mix logits (see
//   hc_weights_row in hyper.rs; the same f32 arithmetic in the same order).
// COLLAPSE: one invocation per (token, channel): Σ_i pre[t, i] · s[t, i, c].
// EXPAND: one invocation per (token, stream k, channel): post[t, k] · y[t, c] +
//   Σ_j comb[t, j, k] · s[t, j, c].

struct Params {
    tokens: u32,
    n: u32,
    mix: u32,
    iters: u32,
    eps: f32,
    width: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;

const MAX_N: u32 = 8u;

#if WEIGHTS
@group(0) @binding(1) var<storage, read> mix: array<f32>;
@group(0) @binding(2) var<storage, read> scale: array<f32>;
@group(0) @binding(3) var<storage, read> base: array<f32>;
@group(0) @binding(4) var<storage, read_write> pre: array<f32>;
@group(0) @binding(5) var<storage, read_write> post: array<f32>;
@group(0) @binding(6) var<storage, read_write> comb: array<f32>;

fn sigmoid(x: f32) -> f32 {
    return 1.0 / (1.0 + exp(-x));
}

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let t = (wid.x + wid.y * nwg.x) * 64u + lid;
    if (t >= p.tokens) {
        return;
    }
    let n = p.n;
    let m = t * p.mix;
    for (var i = 0u; i < n; i++) {
        pre[t * n + i] = sigmoid(mix[m + i] * scale[0] + base[i]) + p.eps;
    }
    if (p.mix == n) {
        for (var i = 0u; i < n; i++) {
            post[t * n + i] = 0.0;
        }
        for (var i = 0u; i < n * n; i++) {
            comb[t * n * n + i] = 0.0;
        }
        return;
    }
    for (var i = 0u; i < n; i++) {
        post[t * n + i] = 2.0 * sigmoid(mix[m + n + i] * scale[1] + base[n + i]);
    }
    var c: array<f32, 64>;
    for (var j = 0u; j < n; j++) {
        var mx = bitcast<f32>(0xff800000u);
        for (var k = 0u; k < n; k++) {
            let v = mix[m + 2u * n + j * n + k] * scale[2] + base[2u * n + j * n + k];
            c[j * MAX_N + k] = v;
            mx = max(mx, v);
        }
        var sum = 0.0;
        for (var k = 0u; k < n; k++) {
            sum += exp(c[j * MAX_N + k] - mx);
        }
        for (var k = 0u; k < n; k++) {
            c[j * MAX_N + k] = exp(c[j * MAX_N + k] - mx) / sum + p.eps;
        }
    }
    for (var it = 0u; it < p.iters; it++) {
        if (it > 0u) {
            for (var j = 0u; j < n; j++) {
                var s = 0.0;
                for (var k = 0u; k < n; k++) {
                    s += c[j * MAX_N + k];
                }
                s += p.eps;
                for (var k = 0u; k < n; k++) {
                    c[j * MAX_N + k] /= s;
                }
            }
        }
        for (var k = 0u; k < n; k++) {
            var s = 0.0;
            for (var j = 0u; j < n; j++) {
                s += c[j * MAX_N + k];
            }
            s += p.eps;
            for (var j = 0u; j < n; j++) {
                c[j * MAX_N + k] /= s;
            }
        }
    }
    for (var j = 0u; j < n; j++) {
        for (var k = 0u; k < n; k++) {
            comb[t * n * n + j * n + k] = c[j * MAX_N + k];
        }
    }
}
#endif

#if COLLAPSE
@group(0) @binding(1) var<storage, read> s: array<f32>;
@group(0) @binding(2) var<storage, read> pre: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let e = (wid.x + wid.y * nwg.x) * 64u + lid;
    if (e >= p.tokens * p.width) {
        return;
    }
    let t = e / p.width;
    let c = e % p.width;
    var a = 0.0;
    for (var i = 0u; i < p.n; i++) {
        a += pre[t * p.n + i] * s[(t * p.n + i) * p.width + c];
    }
    out[e] = a;
}
#endif

#if EXPAND
@group(0) @binding(1) var<storage, read> s: array<f32>;
@group(0) @binding(2) var<storage, read> y: array<f32>;
@group(0) @binding(3) var<storage, read> post: array<f32>;
@group(0) @binding(4) var<storage, read> comb: array<f32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let e = (wid.x + wid.y * nwg.x) * 64u + lid;
    let n = p.n;
    if (e >= p.tokens * n * p.width) {
        return;
    }
    let c = e % p.width;
    let k = (e / p.width) % n;
    let t = e / (p.width * n);
    var mixed = 0.0;
    for (var j = 0u; j < n; j++) {
        mixed += comb[(t * n + j) * n + k] * s[(t * n + j) * p.width + c];
    }
    out[e] = post[t * n + k] * y[t * p.width + c] + mixed;
}
#endif
