//! What every fuzz target that builds a [`ModelConfig`] checks of the result.

use kiln_model::ModelConfig;

/// A config that builds is usable: no zero sizes, query heads grouped evenly over KV heads,
/// and the products that size the weights and a full-context KV cache fit in a u64.
pub fn check_config(cfg: &ModelConfig) {
    for (field, v) in [
        ("hidden", cfg.hidden),
        ("layers", cfg.layers),
        ("heads", cfg.heads),
        ("kv_heads", cfg.kv_heads),
        ("head_dim", cfg.head_dim),
        ("ffn", cfg.ffn),
        ("vocab", cfg.vocab),
        ("max_position", cfg.max_position),
    ] {
        assert!(v > 0, "{field} is 0 in {cfg:?}");
    }
    assert_eq!(cfg.heads % cfg.kv_heads, 0, "{cfg:?}");
    // A panic is how a fuzz target reports a finding: sizes a config accepted must not
    // overflow what loading computes from them.
    let product = |xs: &[usize]| {
        xs.iter()
            .try_fold(1u64, |a, &x| a.checked_mul(x as u64))
            .unwrap_or_else(|| panic!("{xs:?} overflows: {cfg:?}"))
    };
    product(&[cfg.vocab, cfg.hidden, 4]);
    product(&[cfg.layers, cfg.hidden, cfg.ffn, 3, 4]);
    product(&[cfg.layers, cfg.max_position, cfg.kv_heads, cfg.head_dim, 2, 4]);
}
