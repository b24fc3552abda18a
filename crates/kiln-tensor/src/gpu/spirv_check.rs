//! Kernels that no CI adapter can run (lavapipe has no cooperative matrices) are still
//! compiled on the CPU: naga parses and validates each variant with the capability on and
//! writes SPIR-V as wgpu's Vulkan backend would for a Vulkan 1.3 GPU with the feature, and
//! SPIRV-Tools' validator (`spirv-val`'s library, built by the `spirv-tools` crate: Debian
//! 12's `spirv-val` 2023.1 refuses `CooperativeMatrixKHR` as an unknown capability) must
//! accept it.

use naga::back::spv::{self, Capability};
use naga::valid::{Capabilities, ValidationFlags, Validator};

use super::template::{self, TemplateError};

/// Why a kernel variant did not become valid SPIR-V, by the stage that refused it.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SpirvCheckError {
    #[error("template: {0}")]
    Template(#[from] TemplateError),
    /// naga's diagnostics, rendered against the WGSL they point into.
    #[error("naga refused the WGSL:\n{0}")]
    Naga(String),
    #[error("naga could not write SPIR-V: {0}")]
    Write(#[from] spv::Error),
    #[error("SPIRV-Tools' validator refused {what}: {source}")]
    Validator {
        what: String,
        #[source]
        source: spirv_tools::Error,
    },
}

/// What a kernel variant needs of the device, as wgpu's features.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Needs {
    pub f16: bool,
    pub subgroups: bool,
    pub coop: bool,
    /// `VK_KHR_shader_integer_dot_product` (core in Vulkan 1.3): `dot4I8Packed` lowers to
    /// `OpSDot` with it, to shifts and multiplies without.
    pub int_dot: bool,
}

/// naga's validator capabilities for `needs`.
fn validator_caps(needs: Needs) -> Capabilities {
    // `unpack2x16float` and kin: every Vulkan device wgpu opens has it.
    let mut c = Capabilities::SHADER_FLOAT16_IN_FLOAT32;
    c.set(Capabilities::SHADER_FLOAT16, needs.f16);
    c.set(Capabilities::SUBGROUP, needs.subgroups);
    c.set(Capabilities::COOPERATIVE_MATRIX, needs.coop);
    c
}

/// The SPIR-V capabilities wgpu's Vulkan backend declares available for `needs` (its
/// always-available set, then one group a feature).
fn spirv_caps(needs: Needs) -> Vec<Capability> {
    let mut c = vec![
        Capability::Shader,
        Capability::Matrix,
        Capability::Sampled1D,
        Capability::Image1D,
        Capability::ImageQuery,
        Capability::DerivativeControl,
        Capability::StorageImageExtendedFormats,
    ];
    if needs.subgroups {
        c.extend([
            Capability::GroupNonUniform,
            Capability::GroupNonUniformVote,
            Capability::GroupNonUniformArithmetic,
            Capability::GroupNonUniformBallot,
            Capability::GroupNonUniformShuffle,
            Capability::GroupNonUniformShuffleRelative,
            Capability::GroupNonUniformQuad,
        ]);
    }
    if needs.f16 {
        c.push(Capability::Float16);
    }
    if needs.coop {
        c.extend([
            Capability::CooperativeMatrixKHR,
            Capability::VulkanMemoryModel,
        ]);
    }
    if needs.int_dot {
        c.extend([
            Capability::DotProductInputAll,
            Capability::DotProductInput4x8Bit,
            Capability::DotProductInput4x8BitPacked,
            Capability::DotProduct,
        ]);
    }
    c
}

/// `src` rendered with `defines`, validated and written to SPIR-V 1.6 (Vulkan 1.3's) for
/// `needs`; the error names the stage that refused it.
pub(crate) fn to_spirv<V: AsRef<str>>(
    src: &str,
    defines: &[(&str, V)],
    needs: Needs,
) -> Result<Vec<u32>, SpirvCheckError> {
    let wgsl = template::render(src, defines, needs.f16)?;
    let module = naga::front::wgsl::parse_str(&wgsl)
        .map_err(|e| SpirvCheckError::Naga(e.emit_to_string(&wgsl)))?;
    let info = Validator::new(ValidationFlags::all(), validator_caps(needs))
        .validate(&module)
        .map_err(|e| SpirvCheckError::Naga(e.emit_to_string(&wgsl)))?;
    let options = spv::Options {
        lang_version: (1, 6),
        capabilities: Some(spirv_caps(needs).into_iter().collect()),
        ..spv::Options::default()
    };
    let pipeline = spv::PipelineOptions {
        shader_stage: naga::ShaderStage::Compute,
        entry_point: "main".into(),
    };
    Ok(spv::write_vec(&module, &info, &options, Some(&pipeline))?)
}

/// SPIRV-Tools' validator (what `spirv-val --target-env vulkan1.3` runs) on `words`, with
/// [`without_stray_layouts`] applied first.
pub(crate) fn spirv_val(words: &[u32], what: &str) -> Result<(), SpirvCheckError> {
    use spirv_tools::val::Validator as _;
    spirv_tools::val::create(Some(spirv_tools::TargetEnv::Vulkan_1_3))
        .validate(without_stray_layouts(words), None)
        .map_err(|source| SpirvCheckError::Validator {
            what: what.to_owned(),
            source,
        })
}

// Opcodes, storage classes and decorations of the SPIR-V specification that
// `without_stray_layouts` reads.
const OP_TYPE_ARRAY: u32 = 28;
const OP_TYPE_RUNTIME_ARRAY: u32 = 29;
const OP_TYPE_STRUCT: u32 = 30;
const OP_TYPE_POINTER: u32 = 32;
const OP_DECORATE: u32 = 71;
const OP_MEMBER_DECORATE: u32 = 72;
const DECORATION_ARRAY_STRIDE: u32 = 6;
const DECORATION_OFFSET: u32 = 35;
/// Uniform, PushConstant, StorageBuffer, PhysicalStorageBuffer: the storage classes with an
/// explicit layout.
const LAID_OUT: [u32; 4] = [2, 9, 12, 5349];

/// The instructions of `words` after the header: `(opcode, operands)`.
fn instructions(words: &[u32]) -> impl Iterator<Item = (u32, &[u32])> {
    let mut i = 5;
    std::iter::from_fn(move || {
        let first = *words.get(i)?;
        let count = ((first >> 16) as usize).max(1);
        let ops = words.get(i + 1..i + count)?;
        i += count;
        Some((first & 0xffff, ops))
    })
}

/// `words` without the `ArrayStride` and `Offset` decorations naga 30 puts on every array
/// and struct type, also those only workgroup or function variables use
/// (VUID-StandaloneSpirv-None-10684, wgpu issue 7696; the upstream fix, wgpu PR 9295, emits
/// such types without them). Drivers accept them: kiln's whole kernel family runs with them
/// on NVIDIA and lavapipe. Types reachable from a pointer into an explicitly laid-out
/// storage class keep theirs, so the validator still checks every buffer's layout.
pub(crate) fn without_stray_layouts(words: &[u32]) -> Vec<u32> {
    use std::collections::{HashMap, HashSet};
    let mut parts: HashMap<u32, Vec<u32>> = HashMap::new();
    let mut roots = Vec::new();
    for (op, ops) in instructions(words) {
        match op {
            OP_TYPE_ARRAY | OP_TYPE_RUNTIME_ARRAY if ops.len() >= 2 => {
                parts.insert(ops[0], vec![ops[1]]);
            }
            OP_TYPE_STRUCT if !ops.is_empty() => {
                parts.insert(ops[0], ops[1..].to_vec());
            }
            OP_TYPE_POINTER if ops.len() >= 3 && LAID_OUT.contains(&ops[1]) => roots.push(ops[2]),
            _ => {}
        }
    }
    let mut laid_out = HashSet::new();
    while let Some(t) = roots.pop() {
        if laid_out.insert(t) {
            roots.extend(parts.get(&t).into_iter().flatten());
        }
    }
    let stray = |op: u32, ops: &[u32]| match op {
        OP_DECORATE => ops.get(1) == Some(&DECORATION_ARRAY_STRIDE) && !laid_out.contains(&ops[0]),
        OP_MEMBER_DECORATE => ops.get(2) == Some(&DECORATION_OFFSET) && !laid_out.contains(&ops[0]),
        _ => false,
    };
    let mut out = words[..5.min(words.len())].to_vec();
    let mut i = 5;
    for (op, ops) in instructions(words) {
        let end = i + 1 + ops.len();
        if !stray(op, ops) {
            out.extend_from_slice(&words[i..end]);
        }
        i = end;
    }
    out
}

/// `OpSDot`'s opcode (SPV_KHR_integer_dot_product).
pub(crate) const OP_SDOT: u32 = 4450;
/// `OpCooperativeMatrixMulAddKHR`'s opcode (SPV_KHR_cooperative_matrix).
pub(crate) const OP_COOP_MUL_ADD: u32 = 4459;

/// Whether `words` holds an instruction with opcode `op`.
pub(crate) fn has_op(words: &[u32], op: u32) -> bool {
    instructions(words).any(|(o, _)| o == op)
}
