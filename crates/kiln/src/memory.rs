//! The process's own memory use, as `kiln info` and `kiln generate --json` report it.

/// This process's peak resident set size in bytes so far: the kernel's high-water mark
/// (`VmHWM` in `/proc/self/status`) on Linux and Android. `None` elsewhere: other systems
/// report it only through `getrusage`/`GetProcessMemoryInfo`, which std does not wrap, and
/// calling them needs the `unsafe` the workspace forbids.
pub fn peak_rss_bytes() -> Option<u64> {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        vm_hwm(&std::fs::read_to_string("/proc/self/status").ok()?)
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    {
        None
    }
}

/// The `VmHWM:   123456 kB` line of a `/proc/<pid>/status` text, in bytes.
#[cfg_attr(
    not(any(target_os = "linux", target_os = "android", test)),
    allow(dead_code)
)]
fn vm_hwm(status: &str) -> Option<u64> {
    let value = status.lines().find_map(|l| l.strip_prefix("VmHWM:"))?;
    let kib: u64 = value.trim().strip_suffix("kB")?.trim().parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_high_water_mark_in_bytes() {
        let status = "Name:\tkiln\nVmPeak:\t  300 kB\nVmHWM:\t    1234 kB\nVmRSS:\t 1000 kB\n";
        assert_eq!(vm_hwm(status), Some(1234 * 1024));
        assert_eq!(vm_hwm("VmRSS:\t 1000 kB\n"), None);
        assert_eq!(vm_hwm("VmHWM:\t lots kB\n"), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn this_process_has_a_peak() {
        assert!(peak_rss_bytes().is_some_and(|b| b > 0));
    }
}
