// The INT4 cache's Walsh-Hadamard rotation (cache.rs `hadamard`), in place on the first `n`
// elements of `r`: blocks of the largest power of two dividing `n` (at most 256), scaled by
// `norm` = 1/sqrt(block), which the host computes so that every backend scales by the same
// f32. Orthonormal and symmetric: applying it twice gives the row back. Prepended to the
// kernels that write or read an INT4 cache.

fn hadamard(r: ptr<function, array<f32, 256>>, n: u32, norm: f32) {
    let b = min(n & (~n + 1u), 256u);
    for (var h = 1u; h < b; h *= 2u) {
        for (var i = 0u; i < n; i += 2u * h) {
            for (var j = i; j < i + h; j++) {
                let x = (*r)[j];
                let y = (*r)[j + h];
                (*r)[j] = x + y;
                (*r)[j + h] = x - y;
            }
        }
    }
    for (var d = 0u; d < n; d++) {
        (*r)[d] = (*r)[d] * norm;
    }
}

