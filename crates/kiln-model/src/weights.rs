//! Weight names and sources: the model asks for weights by role; a source maps the role to its
//! file format's tensor name and returns a device tensor.

use std::path::Path;

use kiln_gguf::{GgmlType, GgufFile};
use kiln_tensor::{DType, Device, Tensor};

use crate::files::DataFile;
use crate::{ModelError, Result};

/// A weight's role in the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Weight {
    Embed,
    FinalNorm,
    LmHead,
    AttnNorm(usize),
    Q(usize),
    K(usize),
    V(usize),
    QBias(usize),
    KBias(usize),
    VBias(usize),
    O(usize),
    /// The attention output projection's bias (gpt-oss).
    OBias(usize),
    /// Attention sinks, a logit per query head (gpt-oss).
    Sinks(usize),
    FfnNorm(usize),
    Gate(usize),
    Up(usize),
    Down(usize),
    /// Per-head RMSNorm of Q and K (qwen3, gemma3).
    QNorm(usize),
    KNorm(usize),
    /// Gemma 3's norms: after attention, before the MLP (its `ffn_norm` in GGUF), after the
    /// MLP.
    PostAttnNorm(usize),
    PreFfnNorm(usize),
    PostFfnNorm(usize),
    /// A mixture-of-experts layer's router, `[experts, hidden]`, and its bias (gpt-oss).
    Router(usize),
    RouterBias(usize),
    /// One expert's projection: layer, expert, which (HF checkpoints store each expert
    /// apart; llama.cpp stacks them, see [`WeightSource::load_experts`]).
    Expert(usize, usize, ExpertProj),
}

/// The projections of an expert's gated MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertProj {
    Gate,
    Up,
    Down,
}

impl ExpertProj {
    /// llama.cpp's name (`ffn_gate_exps`).
    pub fn gguf(self) -> &'static str {
        match self {
            ExpertProj::Gate => "gate",
            ExpertProj::Up => "up",
            ExpertProj::Down => "down",
        }
    }

    /// transformers' name (Qwen3-MoE's; Mixtral's in [`Weight::hf_aliases`]).
    fn hf(self) -> &'static str {
        match self {
            ExpertProj::Gate => "gate_proj",
            ExpertProj::Up => "up_proj",
            ExpertProj::Down => "down_proj",
        }
    }

    /// Mixtral's name.
    fn mixtral(self) -> &'static str {
        match self {
            ExpertProj::Gate => "w1",
            ExpertProj::Up => "w3",
            ExpertProj::Down => "w2",
        }
    }
}

impl Weight {
    /// The tensor name llama.cpp's GGUF files use.
    pub fn gguf_name(self) -> String {
        use Weight::*;
        match self {
            Embed => "token_embd.weight".into(),
            FinalNorm => "output_norm.weight".into(),
            LmHead => "output.weight".into(),
            AttnNorm(l) => format!("blk.{l}.attn_norm.weight"),
            Q(l) => format!("blk.{l}.attn_q.weight"),
            K(l) => format!("blk.{l}.attn_k.weight"),
            V(l) => format!("blk.{l}.attn_v.weight"),
            QBias(l) => format!("blk.{l}.attn_q.bias"),
            KBias(l) => format!("blk.{l}.attn_k.bias"),
            VBias(l) => format!("blk.{l}.attn_v.bias"),
            O(l) => format!("blk.{l}.attn_output.weight"),
            OBias(l) => format!("blk.{l}.attn_output.bias"),
            Sinks(l) => format!("blk.{l}.attn_sinks.weight"),
            FfnNorm(l) => format!("blk.{l}.ffn_norm.weight"),
            Gate(l) => format!("blk.{l}.ffn_gate.weight"),
            Up(l) => format!("blk.{l}.ffn_up.weight"),
            Down(l) => format!("blk.{l}.ffn_down.weight"),
            QNorm(l) => format!("blk.{l}.attn_q_norm.weight"),
            KNorm(l) => format!("blk.{l}.attn_k_norm.weight"),
            PostAttnNorm(l) => format!("blk.{l}.post_attention_norm.weight"),
            PreFfnNorm(l) => format!("blk.{l}.ffn_norm.weight"),
            PostFfnNorm(l) => format!("blk.{l}.post_ffw_norm.weight"),
            Router(l) => format!("blk.{l}.ffn_gate_inp.weight"),
            RouterBias(l) => format!("blk.{l}.ffn_gate_inp.bias"),
            // Early Mixtral files stored each expert apart.
            Expert(l, e, p) => format!("blk.{l}.ffn_{}.{e}.weight", p.gguf()),
        }
    }

    /// The names other families' checkpoints give a weight that transformers' usual layout
    /// names as [`Weight::hf_name`] says: Mixtral's, then GPT-OSS's (whose experts are stacked
    /// tensors of their own, see `HfSource::load_experts`).
    pub fn hf_aliases(self) -> [Option<String>; HF_ALIAS_FAMILIES] {
        match self {
            Weight::Router(l) => [
                Some(format!("model.layers.{l}.block_sparse_moe.gate.weight")),
                Some(format!("model.layers.{l}.mlp.router.weight")),
            ],
            Weight::Expert(l, e, p) => [
                Some(format!(
                    "model.layers.{l}.block_sparse_moe.experts.{e}.{}.weight",
                    p.mixtral()
                )),
                None,
            ],
            _ => [None, None],
        }
    }

    /// The tensor name Hugging Face checkpoints use.
    pub fn hf_name(self) -> String {
        use Weight::*;
        match self {
            Embed => "model.embed_tokens.weight".into(),
            FinalNorm => "model.norm.weight".into(),
            LmHead => "lm_head.weight".into(),
            AttnNorm(l) => format!("model.layers.{l}.input_layernorm.weight"),
            Q(l) => format!("model.layers.{l}.self_attn.q_proj.weight"),
            K(l) => format!("model.layers.{l}.self_attn.k_proj.weight"),
            V(l) => format!("model.layers.{l}.self_attn.v_proj.weight"),
            QBias(l) => format!("model.layers.{l}.self_attn.q_proj.bias"),
            KBias(l) => format!("model.layers.{l}.self_attn.k_proj.bias"),
            VBias(l) => format!("model.layers.{l}.self_attn.v_proj.bias"),
            O(l) => format!("model.layers.{l}.self_attn.o_proj.weight"),
            OBias(l) => format!("model.layers.{l}.self_attn.o_proj.bias"),
            Sinks(l) => format!("model.layers.{l}.self_attn.sinks"),
            FfnNorm(l) => format!("model.layers.{l}.post_attention_layernorm.weight"),
            Gate(l) => format!("model.layers.{l}.mlp.gate_proj.weight"),
            Up(l) => format!("model.layers.{l}.mlp.up_proj.weight"),
            Down(l) => format!("model.layers.{l}.mlp.down_proj.weight"),
            QNorm(l) => format!("model.layers.{l}.self_attn.q_norm.weight"),
            KNorm(l) => format!("model.layers.{l}.self_attn.k_norm.weight"),
            PostAttnNorm(l) => format!("model.layers.{l}.post_attention_layernorm.weight"),
            PreFfnNorm(l) => format!("model.layers.{l}.pre_feedforward_layernorm.weight"),
            PostFfnNorm(l) => format!("model.layers.{l}.post_feedforward_layernorm.weight"),
            Router(l) => format!("model.layers.{l}.mlp.gate.weight"),
            RouterBias(l) => format!("model.layers.{l}.mlp.router.bias"),
            Expert(l, e, p) => format!("model.layers.{l}.mlp.experts.{e}.{}.weight", p.hf()),
        }
    }
}

/// The layer whose experts a stored tensor belongs to, by the names llama.cpp's files
/// (`blk.L.ffn_*_exps.*`, early Mixtral's `blk.L.ffn_*.E.weight`) and HF checkpoints
/// (`model.layers.L.mlp.experts.*`, Mixtral's `model.layers.L.block_sparse_moe.experts.*`)
/// give them; `None` for every other tensor.
pub(crate) fn expert_layer(name: &str) -> Option<usize> {
    let (layer, rest) = match name.strip_prefix("blk.") {
        Some(rest) => rest.split_once('.')?,
        None => name.strip_prefix("model.layers.")?.split_once('.')?,
    };
    let gguf_stack = rest.starts_with("ffn_") && rest.contains("_exps.");
    let gguf_one = ["gate", "up", "down"].iter().any(|p| {
        rest.strip_prefix(&format!("ffn_{p}."))
            .and_then(|r| r.split_once('.'))
            .is_some_and(|(e, _)| e.parse::<usize>().is_ok())
    });
    let hf = rest.starts_with("mlp.experts.") || rest.starts_with("block_sparse_moe.experts.");
    (gguf_stack || gguf_one || hf)
        .then(|| layer.parse().ok())
        .flatten()
}

/// Checkpoint families whose names [`Weight::hf_aliases`] lists: Mixtral, GPT-OSS.
pub const HF_ALIAS_FAMILIES: usize = 2;

/// A linear layer's weight and the input order it expects.
#[derive(Debug)]
pub struct Linear {
    pub weight: Tensor,
    /// Act-order (GPTQ `desc_act`) checkpoints: the weight's column `j` multiplies input
    /// column `input_perm[j]`, so the input is gathered in this order before the matmul.
    pub input_perm: Option<Vec<u32>>,
}

/// Where weights come from.
pub trait WeightSource {
    /// The file (or folder) in error messages.
    fn describe(&self) -> &str;
    /// Whether the weight is present.
    fn has(&self, w: Weight) -> bool;
    /// The weight's name in this source, for messages.
    fn name_of(&self, w: Weight) -> String {
        format!("{w:?}")
    }
    /// The weight as a device tensor of shape `shape` in its stored dtype (quantized weights
    /// stay quantized; BF16 stays BF16).
    fn load(&self, device: &Device, w: Weight, shape: &[usize]) -> Result<Tensor>;
    /// A projection weight (`[out, in]`), with the input order it expects.
    fn load_linear(&self, device: &Device, w: Weight, shape: &[usize]) -> Result<Linear> {
        Ok(Linear {
            weight: self.load(device, w, shape)?,
            input_perm: None,
        })
    }
    /// Projection `proj` of every expert of layer `layer`, stacked: `[experts, rows, cols]`
    /// of `shape`, in their stored dtype, on `device`. By default each expert's own weight
    /// ([`Weight::Expert`]), their bytes concatenated ([`stack_experts`]).
    fn load_experts(
        &self,
        device: &Device,
        layer: usize,
        proj: ExpertProj,
        shape: [usize; 3],
    ) -> Result<Tensor> {
        stack_experts(self, device, layer, proj, shape)
    }
    /// The bias of projection `proj` of every expert of layer `layer` (gpt-oss), F32
    /// `[experts, rows]` on the host. Gate's and up's are each their own rows.
    fn load_expert_bias(
        &self,
        layer: usize,
        proj: ExpertProj,
        shape: [usize; 2],
    ) -> Result<Vec<f32>> {
        let _ = shape;
        Err(ModelError::Tensor {
            file: self.describe().into(),
            tensor: format!("layer {layer} experts' {} bias", proj.gguf()),
            problem: "missing: this source holds no expert biases".into(),
        })
    }
    /// The weight as an F32 device tensor (norms and biases).
    fn load_f32(&self, device: &Device, w: Weight, shape: &[usize]) -> Result<Tensor> {
        let t = self.load(&Device::Reference, w, shape)?;
        let v = t.to_f32_vec()?;
        Ok(Tensor::from_f32(device, shape, &v)?)
    }
}

/// Every expert's own weight of projection `proj` of layer `layer`, read one by one and
/// uploaded as one stack `[experts, rows, cols]` (they must share a dtype).
pub fn stack_experts<S: WeightSource + ?Sized>(
    src: &S,
    device: &Device,
    layer: usize,
    proj: ExpertProj,
    shape: [usize; 3],
) -> Result<Tensor> {
    let [experts, rows, cols] = shape;
    let parts = (0..experts).map(|e| {
        let w = Weight::Expert(layer, e, proj);
        Ok((
            src.name_of(w),
            src.load(&Device::Reference, w, &[rows, cols])?,
        ))
    });
    let what = format!("layer {layer} experts' {}", proj.gguf());
    stack(device, src.describe(), &what, parts, &shape)
}

/// Host tensors (each named, in order) stacked into one of `shape` on `device`, in the dtype
/// they share (an error names the first that differs); `what` names the stack.
pub(crate) fn stack(
    device: &Device,
    file: &str,
    what: &str,
    parts: impl IntoIterator<Item = Result<(String, Tensor)>>,
    shape: &[usize],
) -> Result<Tensor> {
    let mut bytes = Vec::new();
    let mut dtype = None;
    for part in parts {
        let (name, t) = part?;
        if let Some(d) = dtype.filter(|&d| d != t.dtype()) {
            return Err(ModelError::Tensor {
                file: file.into(),
                tensor: name,
                problem: format!(
                    "stored as {:?}, the first of {what} as {d:?}: a stack shares one dtype",
                    t.dtype()
                ),
            });
        }
        dtype = Some(t.dtype());
        bytes.extend_from_slice(&t.to_bytes()?);
    }
    Tensor::from_bytes(device, dtype.unwrap_or(DType::F32), shape, &bytes).map_err(|source| {
        ModelError::Upload {
            file: file.into(),
            tensor: what.into(),
            source: Box::new(source),
        }
    })
}

/// ggml's I32 type (index tables).
const I32: GgmlType = GgmlType(26);

/// A GGUF file: its head (metadata, tensor infos) parsed at open, each tensor read from the
/// file when it is loaded, so the file's bytes are never held whole.
#[derive(Debug)]
pub struct GgufSource {
    file: GgufFile,
    data: DataFile,
}

impl GgufSource {
    /// Opens `path` and parses its head; tensor data stays in the file until loaded.
    pub fn open(path: &Path) -> Result<Self> {
        let data = DataFile::open(path)?;
        let file = GgufFile::from_reader(
            std::io::BufReader::new(data.handle()),
            data.len(),
            data.name(),
        )?;
        Ok(Self { file, data })
    }

    pub fn file(&self) -> &GgufFile {
        &self.file
    }

    /// Checks that every tensor in the file has a type kiln loads, so such a file is refused
    /// when opened (`kiln info` included), not halfway through uploading its weights.
    pub fn check_types(&self) -> Result<()> {
        match self
            .file
            .tensors()
            .iter()
            .find(|t| DType::of_ggml(t.ggml_type.0).is_none())
        {
            Some(t) => Err(ModelError::Tensor {
                file: self.describe().into(),
                tensor: t.name.clone(),
                problem: unsupported(t.ggml_type),
            }),
            None => Ok(()),
        }
    }
}

/// Why a tensor of type `t` cannot load, listing the types [`dtype_of`] accepts.
fn unsupported(t: GgmlType) -> String {
    let loadable: Vec<&str> = (0..64)
        .map(GgmlType)
        .filter(|&t| DType::of_ggml(t.0).is_some())
        .filter_map(GgmlType::name)
        .collect();
    format!("type {t} is not supported ({})", loadable.join(", "))
}

impl WeightSource for GgufSource {
    fn describe(&self) -> &str {
        self.file.source()
    }

    fn has(&self, w: Weight) -> bool {
        self.file.tensor(&w.gguf_name()).is_some()
    }

    fn name_of(&self, w: Weight) -> String {
        w.gguf_name()
    }

    fn load_experts(
        &self,
        device: &Device,
        layer: usize,
        proj: ExpertProj,
        shape: [usize; 3],
    ) -> Result<Tensor> {
        let name = format!("blk.{layer}.ffn_{}_exps.weight", proj.gguf());
        if self.file.tensor(&name).is_none() && self.has(Weight::Expert(layer, 0, proj)) {
            // Early Mixtral files: one tensor an expert.
            return stack_experts(self, device, layer, proj, shape);
        }
        self.load_tensor(device, &name, &shape)
    }

    fn load_expert_bias(
        &self,
        layer: usize,
        proj: ExpertProj,
        shape: [usize; 2],
    ) -> Result<Vec<f32>> {
        let name = format!("blk.{layer}.ffn_{}_exps.bias", proj.gguf());
        Ok(self
            .load_tensor(&Device::Reference, &name, &shape)?
            .to_f32_vec()?)
    }

    fn load(&self, device: &Device, w: Weight, shape: &[usize]) -> Result<Tensor> {
        self.load_tensor(device, &w.gguf_name(), shape)
    }
}

impl GgufSource {
    /// An I32 index table `name` of `shape` (DeepSeek-V4's `ffn_gate_tid2eid`), as ids.
    pub(crate) fn load_ids(&self, name: &str, shape: &[usize]) -> Result<Vec<u32>> {
        let err = |problem: String| ModelError::Tensor {
            file: self.describe().into(),
            tensor: name.into(),
            problem,
        };
        let info = self
            .file
            .tensor(name)
            .ok_or_else(|| err("missing".into()))?;
        let got: Vec<usize> = info.dims.iter().rev().map(|&d| d as usize).collect();
        if got != shape || info.ggml_type != I32 {
            return Err(err(format!(
                "type {} {got:?}, expected I32 {shape:?}",
                info.ggml_type
            )));
        }
        let range = info
            .data_range()
            .ok_or_else(|| err("its data size is not known".into()))?;
        let data = self.data.read(range, &format!("tensor `{name}`"))?;
        crate::safetensors::decode_ids(
            (self.describe(), name),
            crate::safetensors::StDtype::I32,
            &data,
        )
    }

    /// The tensor `name`, of shape `shape`, uploaded in its stored dtype.
    pub(crate) fn load_tensor(
        &self,
        device: &Device,
        name: &str,
        shape: &[usize],
    ) -> Result<Tensor> {
        let name = name.to_string();
        let err = |problem: String| ModelError::Tensor {
            file: self.describe().into(),
            tensor: name.clone(),
            problem,
        };
        let info = self
            .file
            .tensor(&name)
            .ok_or_else(|| err("missing".into()))?;
        // ggml lists dimensions fastest-first; kiln shapes are row-major.
        let got: Vec<usize> = info.dims.iter().rev().map(|&d| d as usize).collect();
        if got != shape {
            return Err(err(format!(
                "shape {got:?} disagrees with the config's {shape:?}"
            )));
        }
        let dtype =
            DType::of_ggml(info.ggml_type.0).ok_or_else(|| err(unsupported(info.ggml_type)))?;
        let range = info
            .data_range()
            .ok_or_else(|| err("its data size is not known".into()))?;
        // One tensor's bytes, dropped once uploaded.
        let data = self.data.read(range, &format!("tensor `{name}`"))?;
        Tensor::from_bytes(device, dtype, shape, &data).map_err(|source| ModelError::Upload {
            file: self.describe().into(),
            tensor: name.clone(),
            source: Box::new(source),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Expert tensors by every naming, and tensors that are not experts.
    #[test]
    fn expert_tensors_are_told_by_name() {
        for (name, want) in [
            ("blk.3.ffn_gate_exps.weight", Some(3)),
            ("blk.12.ffn_down_exps.bias", Some(12)),
            ("blk.0.ffn_up.7.weight", Some(0)),
            ("model.layers.5.mlp.experts.gate_up_proj_blocks", Some(5)),
            ("model.layers.2.mlp.experts.4.down_proj.weight", Some(2)),
            (
                "model.layers.1.block_sparse_moe.experts.0.w1.weight",
                Some(1),
            ),
            ("blk.3.ffn_gate_inp.weight", None),
            ("blk.3.ffn_gate.weight", None),
            ("model.layers.5.mlp.router.weight", None),
            ("model.layers.5.mlp.gate_proj.weight", None),
            ("token_embd.weight", None),
        ] {
            assert_eq!(expert_layer(name), want, "{name}");
        }
    }

    /// kiln-tensor's format rows and kiln-gguf's table of ggml types agree: each GGUF type kiln
    /// loads names one dtype, whose block sizes are ggml's; kiln's own formats are no GGUF type.
    #[test]
    fn format_rows_agree_with_gguf_types() {
        let mut names = Vec::new();
        for &d in DType::WEIGHTS {
            let Some(id) = d.ggml() else {
                assert!(matches!(d, DType::Q4_Z | DType::Q8_Z | DType::FP8), "{d:?}");
                continue;
            };
            let t = GgmlType(id);
            assert_eq!(DType::of_ggml(id), Some(d), "{t}");
            let layout = t.block_layout().unwrap_or_else(|| panic!("{t}: no layout"));
            assert_eq!(
                (layout.block_elems as usize, layout.block_bytes as usize),
                (d.block_elems(), d.block_bytes()),
                "{t}"
            );
            names.push(t.name().unwrap_or_default());
        }
        let want = [
            "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
            "Q5_K", "Q6_K", "MXFP4",
        ];
        assert_eq!(names, want);
        assert_eq!(
            DType::of_ggml(GgmlType::Q8_1.0),
            None,
            "no kernel reads Q8_1"
        );
    }
}
