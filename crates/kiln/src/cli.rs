//! Command-line parsing: `kiln <command> --flag value ...` (DESIGN.md §5 names every flag).

use std::collections::HashMap;

pub const USAGE: &str = "usage:
  kiln serve    --model PATH [--listen 127.0.0.1:50051] [--metrics-listen 127.0.0.1:9464|off]
                [--backend auto|wgpu|cpu] [--model-id NAME] [--api-key KEY (or KILN_API_KEY)]
                [--kv-cache-memory BYTES] [--kv-dtype f16|f32|int8] [--block-size N]
                [--max-num-seqs N] [--max-num-batched-tokens N] [--max-waiting N]
                [--max-model-len N] [--max-new-tokens N] [--default-max-new-tokens N]
                [--drain-timeout SECONDS] [--dtype f16|f32] [--quantize q8_0|q4_0|q4_1]
                [SPECULATIVE]
  kiln generate --model PATH --prompt TEXT [--max-tokens N] [--temperature T] [--top-k K]
                [--top-p P] [--min-p P] [--repetition-penalty R] [--stop TEXT]
                [--seed S] [--backend auto|wgpu|cpu] [--chat] [--json]
                [--dtype f16|f32] [--quantize q8_0|q4_0|q4_1]   (HF folders)
                [SPECULATIVE]
  kiln tokenize --model PATH --text TEXT
  kiln info     --model PATH [--backend auto|wgpu|cpu] [--kv-cache-memory BYTES]

SPECULATIVE (speculative decoding; off by default):
                [--speculative ngram|draft|off] [--draft-model PATH (implies draft)]
                [--num-speculative-tokens K (4)] [--prompt-lookup-min N (1)]
                [--prompt-lookup-max N (3)] [--speculative-disable-batch-size N (8: no
                speculation in a step while more sequences run)]

PATH is a .gguf file or a Hugging Face folder (config.json, tokenizer files, model.safetensors
or model.safetensors.index.json).";

/// Parsed flags of one command.
#[derive(Debug, Clone)]
pub struct Args {
    values: HashMap<String, String>,
    switches: Vec<String>,
}

const SWITCHES: &[&str] = &["json", "chat"];

impl Args {
    pub fn parse(command: &str, raw: &[String], allowed: &[&str]) -> Result<Self, String> {
        let mut values = HashMap::new();
        let mut switches = Vec::new();
        let mut it = raw.iter();
        while let Some(a) = it.next() {
            let name = a
                .strip_prefix("--")
                .ok_or_else(|| format!("{command}: unexpected argument `{a}`"))?;
            let (name, inline) = match name.split_once('=') {
                Some((n, v)) => (n, Some(v.to_string())),
                None => (name, None),
            };
            if !allowed.contains(&name) {
                return Err(format!("{command}: unknown flag --{name}"));
            }
            if SWITCHES.contains(&name) {
                switches.push(name.to_string());
                continue;
            }
            let v = match inline {
                Some(v) => v,
                None => it
                    .next()
                    .cloned()
                    .ok_or_else(|| format!("{command}: --{name} needs a value"))?,
            };
            values.insert(name.to_string(), v);
        }
        Ok(Self { values, switches })
    }

    pub fn required(&self, name: &str) -> Result<&str, String> {
        self.values
            .get(name)
            .map(String::as_str)
            .ok_or_else(|| format!("missing --{name}"))
    }

    pub fn get(&self, name: &str) -> Option<&str> {
        self.values.get(name).map(String::as_str)
    }

    pub fn switch(&self, name: &str) -> bool {
        self.switches.iter().any(|s| s == name)
    }

    /// A typed flag value, with the flag named in the error.
    pub fn parsed<T: std::str::FromStr>(&self, name: &str) -> Result<Option<T>, String>
    where
        T::Err: std::fmt::Display,
    {
        self.get(name)
            .map(|v| v.parse::<T>().map_err(|e| format!("--{name} {v}: {e}")))
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn flags_switches_and_errors() {
        let a = Args::parse(
            "generate",
            &s(&["--model", "m.gguf", "--json", "--top-k=5"]),
            &["model", "json", "top-k"],
        )
        .unwrap();
        assert_eq!(a.required("model").unwrap(), "m.gguf");
        assert!(a.switch("json"));
        assert_eq!(a.parsed::<usize>("top-k").unwrap(), Some(5));
        assert!(a.required("prompt").unwrap_err().contains("--prompt"));
        assert!(
            Args::parse("x", &s(&["--nope", "1"]), &["model"])
                .unwrap_err()
                .contains("unknown flag --nope")
        );
        assert!(
            Args::parse("x", &s(&["--model"]), &["model"])
                .unwrap_err()
                .contains("needs a value")
        );
        assert!(
            Args::parse("x", &s(&["stray"]), &["model"])
                .unwrap_err()
                .contains("unexpected argument")
        );
        let a = Args::parse("x", &s(&["--top-k", "many"]), &["top-k"]).unwrap();
        assert!(
            a.parsed::<usize>("top-k")
                .unwrap_err()
                .contains("--top-k many")
        );
    }
}
