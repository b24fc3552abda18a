//! [`ModelFiles`]: a model path as users pass it — a `.gguf` file or a Hugging Face folder —
//! opened into its config and weight source; [`DataFile`], the positioned reads both formats
//! load tensors with, so no file is ever held in memory whole.

use std::fs::File;
use std::io::ErrorKind;
use std::ops::Range;
use std::path::{Path, PathBuf};

use crate::hf_source::{HfSource, LoadOptions};
use crate::weights::{GgufSource, WeightSource};
use crate::{HfQuant, ModelConfig, ModelError, Result};

/// Which format a model path holds.
#[derive(Debug)]
pub enum ModelSource {
    Gguf(GgufSource),
    /// An HF folder: `config.json` plus safetensors weights (tokenizer files beside them).
    Hf {
        dir: PathBuf,
        weights: HfSource,
    },
}

/// A model's config and weights, from either format.
#[derive(Debug)]
pub struct ModelFiles {
    config: ModelConfig,
    source: ModelSource,
}

impl ModelFiles {
    /// Opens `path`: a folder is read as an HF model folder, anything else as a GGUF file.
    /// `options` apply to HF float weights; a GGUF file loads as stored and refuses them.
    pub fn open(path: &Path, options: LoadOptions) -> Result<Self> {
        if path.is_dir() {
            let cfg_path = path.join("config.json");
            let text = std::fs::read_to_string(&cfg_path).map_err(|source| ModelError::Io {
                path: cfg_path.clone(),
                source,
            })?;
            let cfg_name = cfg_path.display().to_string();
            let config = ModelConfig::from_hf_json(&cfg_name, &text)?;
            let quant = HfQuant::from_hf_json(&cfg_name, &text)?;
            let mut weights = HfSource::open(path, options)?.with_quant(quant);
            weights.arch = Some(config.arch);
            return Ok(Self {
                config,
                source: ModelSource::Hf {
                    dir: path.to_path_buf(),
                    weights,
                },
            });
        }
        if options != LoadOptions::default() {
            return Err(ModelError::Config {
                file: path.display().to_string(),
                field: "dtype/quantize".into(),
                problem:
                    "load-time casts apply to Hugging Face folders; GGUF weights load as stored"
                        .into(),
            });
        }
        let gguf = GgufSource::open(path)?;
        let config = ModelConfig::from_gguf(gguf.file())?;
        gguf.check_types()?;
        Ok(Self {
            config,
            source: ModelSource::Gguf(gguf),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn source(&self) -> &ModelSource {
        &self.source
    }

    /// The weights, for [`crate::Model::load`].
    pub fn weights(&self) -> &dyn WeightSource {
        match &self.source {
            ModelSource::Gguf(g) => g,
            ModelSource::Hf { weights, .. } => weights,
        }
    }

    /// Bytes of weight data as stored in the file(s).
    pub fn stored_bytes(&self) -> u64 {
        self.stored_bytes_where(|_| true)
    }

    /// Bytes as stored of the expert weights (and their biases) of the layers `which` picks:
    /// what `--cpu-moe` keeps in host memory.
    pub fn stored_expert_bytes(&self, which: impl Fn(usize) -> bool) -> u64 {
        self.stored_bytes_where(|name| crate::weights::expert_layer(name).is_some_and(&which))
    }

    /// Bytes as stored of the tensors whose names `keep` picks.
    fn stored_bytes_where(&self, keep: impl Fn(&str) -> bool) -> u64 {
        match &self.source {
            ModelSource::Gguf(g) => g
                .file()
                .tensors()
                .iter()
                .filter(|t| keep(&t.name))
                .filter_map(|t| t.byte_size)
                .sum(),
            ModelSource::Hf { weights, .. } => weights.stored_bytes_where(keep),
        }
    }
}

/// An open weights file read in pieces: each tensor is read into a buffer of its own size when
/// it is loaded and dropped once uploaded, so loading holds at most one tensor beyond the
/// weights themselves.
#[derive(Debug)]
pub(crate) struct DataFile {
    name: String,
    file: File,
    len: u64,
    /// Where std has no positioned read, reads seek the shared handle one at a time.
    #[cfg(not(any(unix, windows)))]
    seek: std::sync::Mutex<()>,
}

impl DataFile {
    pub(crate) fn open(path: &Path) -> Result<Self> {
        let io = |source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        Ok(Self {
            name: path.display().to_string(),
            file,
            len,
            #[cfg(not(any(unix, windows)))]
            seek: std::sync::Mutex::new(()),
        })
    }

    /// The path, as errors name it.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Length of the file when it was opened.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// The handle, for parsing a file's head through a buffered reader before any tensor read.
    pub(crate) fn handle(&self) -> &File {
        &self.file
    }

    /// Bytes `range` of the file in a buffer of exactly that size; `what` names them in errors
    /// ("tensor `x`"). The range is checked against the file's length before anything is
    /// allocated, and an allocation that fails is an error, not an abort.
    pub(crate) fn read(&self, range: Range<u64>, what: &str) -> Result<Vec<u8>> {
        let err = |source| ModelError::Read {
            file: self.name.clone(),
            what: what.to_string(),
            start: range.start,
            end: range.end,
            source,
        };
        if range.start > range.end || range.end > self.len {
            return Err(err(std::io::Error::new(
                ErrorKind::UnexpectedEof,
                format!("the file has {} bytes: truncated?", self.len),
            )));
        }
        let n = usize::try_from(range.end - range.start).map_err(|_| {
            err(std::io::Error::new(
                ErrorKind::OutOfMemory,
                "more bytes than this machine can address",
            ))
        })?;
        let mut buf = Vec::new();
        buf.try_reserve_exact(n)
            .map_err(|e| err(std::io::Error::new(ErrorKind::OutOfMemory, e)))?;
        buf.resize(n, 0);
        self.read_exact_at(&mut buf, range.start).map_err(err)?;
        Ok(buf)
    }

    #[cfg(unix)]
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(&self.file, buf, offset)
    }

    #[cfg(windows)]
    fn read_exact_at(&self, mut buf: &mut [u8], mut offset: u64) -> std::io::Result<()> {
        use std::os::windows::fs::FileExt;
        while !buf.is_empty() {
            match self.file.seek_read(buf, offset) {
                Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
                Ok(n) => {
                    buf = &mut buf[n..];
                    offset += n as u64;
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    #[cfg(not(any(unix, windows)))]
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        use std::io::{Read, Seek, SeekFrom};
        // A poisoned lock guards nothing that could be left half-done: the seek comes first.
        let _one_at_a_time = self.seek.lock().unwrap_or_else(|p| p.into_inner());
        let mut file = &self.file;
        file.seek(SeekFrom::Start(offset))?;
        file.read_exact(buf)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn reads_exact_ranges_and_refuses_ones_past_the_end() {
        let path = std::env::temp_dir().join(format!("kiln-datafile-{}", std::process::id()));
        std::fs::write(&path, b"0123456789").unwrap();
        let f = DataFile::open(&path).unwrap();
        assert_eq!(f.read(2..5, "x").unwrap(), b"234");
        assert_eq!(f.read(10..10, "x").unwrap(), b"");
        let e = f.read(8..12, "tensor `t`").unwrap_err();
        let text = format!("{e}: {}", std::error::Error::source(&e).unwrap());
        assert!(
            text.contains("tensor `t`") && text.contains("truncated"),
            "{text}"
        );
        assert!(text.contains(&path.display().to_string()), "{text}");
        std::fs::remove_file(&path).unwrap();
    }
}
