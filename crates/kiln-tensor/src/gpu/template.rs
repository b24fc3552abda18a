//! The small template step that specialises WGSL sources.
//!
//! - `#if NAME` / `#else` / `#endif` keep or drop lines (nesting allowed); `NAME` is true when
//!   it is defined with a value other than `0`, or when it is `F16` and the device has
//!   `SHADER_F16` enabled.
//! - `{{NAME}}` is replaced by the define's value.

use std::hash::{Hash, Hasher};

/// Cache key naming the kernel and every specialisation axis. Defines whose value spans
/// several lines are code the launcher generated from the other defines, so they are left out.
pub(crate) fn cache_key<V: AsRef<str>>(kernel: &str, defines: &[(&str, V)]) -> String {
    let mut d: Vec<String> = keyed(defines)
        .map(|(k, v)| format!("{k}={}", v.as_ref()))
        .collect();
    d.sort();
    format!("{kernel}[{}]", d.join(","))
}

/// The defines that name a specialisation: code blocks (multi-line values) follow from the
/// others and are left out.
pub(crate) fn keyed<'a, V: AsRef<str>>(
    defines: &'a [(&'a str, V)],
) -> impl Iterator<Item = &'a (&'a str, V)> {
    defines.iter().filter(|(_, v)| !v.as_ref().contains('\n'))
}

/// A hash of `kernel` and its [`keyed`] defines in the order given (a launch site gives them
/// in the same order every time).
pub(crate) fn launch_hash<V: AsRef<str>>(kernel: &str, defines: &[(&str, V)]) -> u64 {
    let mut h = rustc_hash::FxHasher::default();
    kernel.hash(&mut h);
    for (k, v) in keyed(defines) {
        k.hash(&mut h);
        v.as_ref().hash(&mut h);
    }
    h.finish()
}

/// `known` (as stored) holds exactly `defines`' keyed ones, in the same order.
pub(crate) fn same_defines<V: AsRef<str>>(
    known: &[(String, String)],
    defines: &[(&str, V)],
) -> bool {
    let mut given = keyed(defines);
    known.iter().all(|(k, v)| {
        given
            .next()
            .is_some_and(|(gk, gv)| gk == k && gv.as_ref() == v)
    }) && given.next().is_none()
}

/// Why a kernel template does not render.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    #[error("line {0}: #else without #if")]
    ElseWithoutIf(usize),
    #[error("line {0}: #endif without #if")]
    EndifWithoutIf(usize),
    #[error("unterminated #if")]
    Unterminated,
    #[error("undefined template value {0}")]
    Undefined(String),
}

pub(crate) fn render<V: AsRef<str>>(
    src: &str,
    defines: &[(&str, V)],
    f16: bool,
) -> Result<String, TemplateError> {
    let truthy = |name: &str| {
        if name == "F16" {
            return f16;
        }
        defines.iter().any(|(k, v)| *k == name && v.as_ref() != "0")
    };
    let mut out = String::with_capacity(src.len() + 64);
    if f16 {
        out.push_str("enable f16;\n");
    }
    // Each entry: (this branch active, any enclosing branch inactive)
    let mut stack: Vec<(bool, bool)> = Vec::new();
    for (n, line) in src.lines().enumerate() {
        let t = line.trim_start();
        let parent_off = stack.last().is_some_and(|&(on, off)| !on || off);
        if let Some(name) = t.strip_prefix("#if ") {
            stack.push((truthy(name.trim()), parent_off));
        } else if t.starts_with("#else") {
            let top = stack
                .last_mut()
                .ok_or(TemplateError::ElseWithoutIf(n + 1))?;
            top.0 = !top.0;
        } else if t.starts_with("#endif") {
            stack.pop().ok_or(TemplateError::EndifWithoutIf(n + 1))?;
        } else if !parent_off {
            out.push_str(line);
            out.push('\n');
        }
    }
    if !stack.is_empty() {
        return Err(TemplateError::Unterminated);
    }
    for (k, v) in defines {
        out = out.replace(&format!("{{{{{k}}}}}"), v.as_ref());
    }
    if let Some(at) = out.find("{{") {
        let end = out[at..].find("}}").map_or(out.len(), |e| at + e + 2);
        return Err(TemplateError::Undefined(out[at..end].to_owned()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_launch_finds_its_pipeline_by_the_defines_it_gives() {
        let d = |v: &[(&'static str, &str)]| -> Vec<(&'static str, String)> {
            v.iter().map(|(k, v)| (*k, v.to_string())).collect()
        };
        let given = d(&[("A", "1"), ("B", "x"), ("CODE", "s += 1;\ns += 2;\n")]);
        let known: Vec<(String, String)> = keyed(&given)
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        assert_eq!(known.len(), 2, "code blocks are not part of the key");
        assert!(same_defines(&known, &given));
        // The code block follows from the others: it changes neither the hash nor the match.
        let other_code = d(&[("A", "1"), ("B", "x"), ("CODE", "t;\nu;\n")]);
        assert!(same_defines(&known, &other_code));
        assert_eq!(launch_hash("k", &given), launch_hash("k", &other_code));
        for differs in [
            d(&[("A", "1"), ("B", "y")]),
            d(&[("A", "1")]),
            d(&[("A", "1"), ("B", "x"), ("C", "0")]),
            // Another order is another entry (the full key, sorted, still finds the pipeline).
            d(&[("B", "x"), ("A", "1")]),
        ] {
            assert!(!same_defines(&known, &differs), "{differs:?}");
        }
        assert_ne!(launch_hash("k", &given), launch_hash("j", &given));
        assert_eq!(
            cache_key("k", &given),
            cache_key("k", &d(&[("B", "x"), ("A", "1")]))
        );
    }

    #[test]
    fn conditionals_and_values() {
        let src =
            "a\n#if X\nb {{N}}\n#if Y\nc\n#else\nd\n#endif\n#else\ne\n#endif\n#if F16\nh\n#endif\n";
        let d = [("X", "1".to_string()), ("N", "7".to_string())];
        assert_eq!(render(src, &d, false).unwrap(), "a\nb 7\nd\n");
        assert_eq!(
            render(src, &[("N", "1")], true).unwrap(),
            "enable f16;\na\ne\nh\n"
        );
        assert!(render::<&str>("#if X\n", &[], false).is_err());
        assert!(render::<&str>("#endif\n", &[], false).is_err());
        assert!(
            render::<&str>("{{Q}}", &[], false)
                .unwrap_err()
                .to_string()
                .contains("{{Q}}")
        );
        assert_eq!(cache_key("k", &[("B", "2"), ("A", "1")]), "k[A=1,B=2]");
    }
}
