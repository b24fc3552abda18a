//! The small template step that specialises WGSL sources.
//!
//! - `#if NAME` / `#else` / `#endif` keep or drop lines (nesting allowed); `NAME` is true when
//!   it is defined with a value other than `0`, or when it is `F16` and the device has
//!   `SHADER_F16` enabled.
//! - `{{NAME}}` is replaced by the define's value.

/// Cache key naming the kernel and every specialisation axis. Defines whose value spans
/// several lines are code the launcher generated from the other defines, so they are left out.
pub(crate) fn cache_key(kernel: &str, defines: &[(&str, String)]) -> String {
    let mut d: Vec<String> = defines
        .iter()
        .filter(|(_, v)| !v.contains('\n'))
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    d.sort();
    format!("{kernel}[{}]", d.join(","))
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

pub(crate) fn render(
    src: &str,
    defines: &[(&str, String)],
    f16: bool,
) -> Result<String, TemplateError> {
    let truthy = |name: &str| {
        if name == "F16" {
            return f16;
        }
        defines.iter().any(|(k, v)| *k == name && v != "0")
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
        out = out.replace(&format!("{{{{{k}}}}}"), v);
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
    fn conditionals_and_values() {
        let src =
            "a\n#if X\nb {{N}}\n#if Y\nc\n#else\nd\n#endif\n#else\ne\n#endif\n#if F16\nh\n#endif\n";
        let d = [("X", "1".to_string()), ("N", "7".to_string())];
        assert_eq!(render(src, &d, false).unwrap(), "a\nb 7\nd\n");
        assert_eq!(
            render(src, &[("N", "1".into())], true).unwrap(),
            "enable f16;\na\ne\nh\n"
        );
        assert!(render("#if X\n", &[], false).is_err());
        assert!(render("#endif\n", &[], false).is_err());
        assert!(
            render("{{Q}}", &[], false)
                .unwrap_err()
                .to_string()
                .contains("{{Q}}")
        );
        assert_eq!(
            cache_key("k", &[("B", "2".into()), ("A", "1".into())]),
            "k[A=1,B=2]"
        );
    }
}
