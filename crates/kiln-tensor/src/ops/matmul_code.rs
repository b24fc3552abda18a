//! The WGSL `matmul_rows.wgsl` is specialised with, written by the launcher: how X is read
//! (subgroup broadcast or not) and the accumulator statements for a group of rows, written
//! once per shape.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock, PoisonError};

use super::Define;

/// Rows of W each invocation of the CPU-adapter kernel computes: each block of X it reads
/// serves all of them (measured on lavapipe: 8 beat 2, 4 and 16 for one row of X and for 16).
pub(super) const ROWS_R: usize = 8;

/// Defines of the X reads of `matmul_rows.wgsl`: by subgroup broadcast where every subgroup
/// has at least the 8 lanes one block of X needs.
pub(super) fn rows_x_broadcast(info: Option<&crate::DeviceInfo>) -> Vec<Define> {
    let sg = info.is_some_and(|i| i.subgroups && i.subgroup_size.0 >= 8);
    super::subgroup_switch("SG_X", sg)
}

/// The accumulator code of `matmul_rows.wgsl` for `m` rows of X and `r` rows of W an
/// invocation (and as many up rows when gated), written out statement by statement: the R
/// weight blocks are decoded once and each X block is read once per block and used for all
/// of them. Under `norm` each X block is scaled by the norm's weights `g` as it is read, and
/// its squares summed for the row's scale, applied at the store. Under `qsum` (the kernel's
/// `QSUM`) a weight block is its quants with (d, m), and each X block is prepared for them
/// (`xprep`) and summed for the m term.
pub(super) fn rows_accumulators(
    m: usize,
    r: usize,
    gated: bool,
    norm: bool,
    qsum: bool,
) -> [Define; 3] {
    // Written out once per shape and kept for the process (a few shapes: `m` is at most a
    // group of rows, `r` is ROWS_R), so a launch's recording costs a hash lookup, no copy.
    type Code = [(&'static str, &'static str); 3];
    type Memo = Mutex<HashMap<(usize, usize, bool, bool, bool), Code>>;
    static MEMO: OnceLock<Memo> = OnceLock::new();
    let memo = MEMO.get_or_init(Default::default);
    let mut memo = memo.lock().unwrap_or_else(PoisonError::into_inner);
    let code = *memo.entry((m, r, gated, norm, qsum)).or_insert_with(|| {
        write_accumulators(m, r, gated, norm, qsum)
            .map(|(k, v)| (k, &*Box::leak(v.into_boxed_str())))
    });
    code.map(|(k, v)| (k, Cow::Borrowed(v)))
}

fn write_accumulators(
    m: usize,
    r: usize,
    gated: bool,
    norm: bool,
    qsum: bool,
) -> [(&'static str, String); 3] {
    let mut decl = String::new();
    let mut body = String::new();
    let mut store = String::new();
    for rr in 0..r {
        body.push_str(&format!(
            "let w{rr} = load_row(min(r0 + {rr}u, last), blk, nb);\n"
        ));
        if gated {
            body.push_str(&format!(
                "let g{rr} = load_row(min(r0 + {rr}u, last) + p.n1, blk, nb);\n"
            ));
        }
    }
    for i in 0..m {
        if norm {
            decl.push_str(&format!("var s{i} = 0.0;\n"));
            body.push_str(&format!(
                "{{ let xr = xblk({i}u * kv + xb, lane);\ns{i} += bdot(xr, xr);\nlet xn = bmul(xr, g);\n"
            ));
            store.push_str(&format!(
                "let sc{i} = inverseSqrt(s{i} / f32(p.k) + p.eps);\n"
            ));
        } else {
            body.push_str(&format!("{{ let xn = xblk({i}u * kv + xb, lane);\n"));
            store.push_str(&format!("let sc{i} = 1.0;\n"));
        }
        let dot: fn(String) -> String = if qsum {
            body.push_str("let x = xprep(xn);\nlet xs = bsum(xn);\n");
            |w: String| format!("qdot({w}, x, xs)")
        } else {
            body.push_str("let x = xn;\n");
            |w: String| format!("bdot({w}, x)")
        };
        for rr in 0..r {
            decl.push_str(&format!("var a{i}_{rr} = 0.0;\n"));
            body.push_str(&format!("a{i}_{rr} += {};\n", dot(format!("w{rr}"))));
            if gated {
                decl.push_str(&format!("var u{i}_{rr} = 0.0;\n"));
                body.push_str(&format!("u{i}_{rr} += {};\n", dot(format!("g{rr}"))));
                store.push_str(&format!(
                    "store({i}u, r0 + {rr}u, a{i}_{rr}, u{i}_{rr}, sc{i});\n"
                ));
            } else {
                store.push_str(&format!(
                    "store({i}u, r0 + {rr}u, a{i}_{rr}, 0.0, sc{i});\n"
                ));
            }
        }
        body.push_str("}\n");
    }
    [("ACC_DECL", decl), ("ACC_BODY", body), ("ACC_STORE", store)]
}
