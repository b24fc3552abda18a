// The gated MLP's activation, glu(gate, up), shared by every kernel that applies it: silu(gate)
// · up by default; GELU-tanh(gate) · up under GELU; GPT-OSS's clamped SwiGLU under OAI:
// (clamp(up, -7, 7) + 1) · g · sigmoid(1.702 · g) with g = min(gate, 7); DeepSeek-V4's
// clamped SwiGLU under CLAMP (its value the bound L): silu(min(gate, L)) · clamp(up, -L, L).

// tanh of an argument clamped to ±15, where f32 tanh is already ±1: some drivers compute tanh
// through exp and return NaN for large arguments.
fn tanh_safe(t: f32) -> f32 {
    return tanh(clamp(t, -15.0, 15.0));
}

// GELU, tanh approximation (`gelu_pytorch_tanh`).
fn gelu_tanh(g: f32) -> f32 {
    return 0.5 * g * (1.0 + tanh_safe(0.7978845608028654 * (g + 0.044715 * g * g * g)));
}

fn glu(gate: f32, up: f32) -> f32 {
#if GELU
    return gelu_tanh(gate) * up;
#else
#if OAI
    let g = min(gate, 7.0);
    return g / (1.0 + exp(-1.702 * g)) * (clamp(up, -7.0, 7.0) + 1.0);
#else
#if CLAMP
    let g = min(gate, {{CLAMP}});
    return g / (1.0 + exp(-g)) * clamp(up, -{{CLAMP}}, {{CLAMP}});
#else
    return gate / (1.0 + exp(-gate)) * up;
#endif
#endif
#endif
}
