//! Run kiln's kernels on a wgpu device and check them against the CPU reference backend, then
//! define and launch a kernel of your own with [`KernelDef`] and [`Recorder::launch`], the way
//! kiln-attention adds its paged-attention kernels.
//!
//! `cargo run --release -p kiln-tensor --example kernels` (needs a Vulkan, Metal or DX12
//! adapter; Mesa's lavapipe will do).

use std::process::ExitCode;

use kiln_tensor::{
    Access, BackendChoice, DType, Device, DeviceOptions, KernelDef, Recorder, Tensor, TensorError,
};

/// `y[i] = a * x[i] + y[i]`, in place; `{{OP}}` is filled at launch from the defines.
static AXPY: KernelDef = KernelDef {
    name: "example_axpy",
    source: r#"
struct Params { n: u32, a: f32, _pad0: u32, _pad1: u32 }
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * 64u + lid;
    if (i >= p.n) { return; }
    y[i] = p.a * x[i] {{OP}} y[i];
}
"#,
    bindings: &[Access::Read, Access::ReadWrite],
};

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct AxpyParams {
    n: u32,
    a: f32,
    _pad: [u32; 2],
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kernels example: {e}");
            ExitCode::FAILURE
        }
    }
}

/// A Q4_1 matmul of two rows, then a softmax over each row of the product.
fn layer(dev: &Device, x: &[f32], w: &[f32], k: usize, n: usize) -> Result<Vec<f32>, TensorError> {
    let x = Tensor::from_f32(dev, &[2, k], x)?;
    let w = Tensor::quantize_f32(dev, DType::Q4_1, &[n, k], w)?;
    let mut rec = Recorder::new(dev);
    let y = rec.matmul(&x, &w, None)?;
    let p = rec.softmax(&y)?;
    rec.submit()?;
    p.to_f32_vec()
}

fn run() -> Result<(), TensorError> {
    let gpu = Device::new(&DeviceOptions {
        backend: BackendChoice::Wgpu,
        ..DeviceOptions::default()
    })?;
    println!("device: {}", gpu.info());

    // Built-in kernels: the same product on the GPU and on the CPU reference.
    let (k, n) = (256, 96);
    let x: Vec<f32> = (0..2 * k)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
        .collect();
    let w: Vec<f32> = (0..n * k)
        .map(|i| ((i * 53 % 97) as f32 - 48.0) / 96.0)
        .collect();
    let on_gpu = layer(&gpu, &x, &w, k, n)?;
    let on_cpu = layer(&Device::reference(), &x, &w, k, n)?;
    let worst = on_gpu
        .iter()
        .zip(&on_cpu)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    println!(
        "Q4_1 matmul + softmax, 2 x {n}: largest difference from the CPU reference {worst:.2e}"
    );
    if worst > 1e-4 {
        return Err(TensorError::Invalid {
            op: "example",
            detail: format!("the GPU differs from the CPU reference by {worst}"),
        });
    }

    // A kernel of our own, specialised at launch by a define.
    let len = 1000;
    let xs = Tensor::from_f32(
        &gpu,
        &[len],
        &(0..len).map(|i| i as f32).collect::<Vec<_>>(),
    )?;
    let ys = Tensor::from_f32(&gpu, &[len], &vec![1.0; len])?;
    let params = AxpyParams {
        n: len as u32,
        a: 2.0,
        _pad: [0; 2],
    };
    let mut rec = Recorder::new(&gpu);
    let groups = len.div_ceil(64) as u32;
    rec.launch(&AXPY, &[("OP", "+".into())], &params, &[&xs, &ys], groups)?;
    rec.launch(&AXPY, &[("OP", "-".into())], &params, &[&xs, &ys], groups)?;
    rec.submit()?;
    // (2x + 1) then 2x - (2x + 1) = -1 everywhere.
    let got = ys.to_f32_vec()?;
    println!("custom kernel: y[0..4] = {:?}", &got[..4]);
    if got.iter().any(|&v| v != -1.0) {
        return Err(TensorError::Invalid {
            op: "example_axpy",
            detail: "expected -1 everywhere".into(),
        });
    }
    Ok(())
}
