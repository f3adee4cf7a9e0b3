//! The kernel tests as a list the library carries (feature `kernel-checks`),
//! so that they run wherever the library does: `cargo test` runs each one as
//! a test of its own (same name), and the browser page web/checks.html runs
//! the same functions on the browser's WebGPU (Dawn and Tint there, beside
//! lavapipe and naga here).
//!
//! A check is a kernel test: each kernel variant against its CPU reference
//! on awkward shapes. It fails by panicking (the tests' assertions); in
//! wasm32 a panic traps the instance, so the page reloads and goes on with
//! the next check. What a check does not run on a device (a feature it
//! lacks) it says in a note, which the check's outcome carries.
//!
//! Each test module lists its checks at its end with [`register!`]; a test
//! here fails when a kernel test is in no list and not marked native-only.

use std::cell::RefCell;

/// One kernel test, runnable outside `cargo test`.
pub struct Check {
    path: &'static str,
    run: fn(),
}

impl Check {
    /// A check named by its test's path (`module_path!()::name`).
    pub const fn new(path: &'static str, run: fn()) -> Self {
        Check { path, run }
    }

    /// The test's name as `cargo test` prints it
    /// (`kernels::attention::tests::...`).
    pub fn name(&self) -> &'static str {
        self.path.strip_prefix("sieve::").unwrap_or(self.path)
    }

    /// Runs the check and returns its notes (what it left out on this
    /// device, and why). A failure panics.
    pub fn run(&self) -> Vec<String> {
        NOTES.with(|n| n.borrow_mut().clear());
        (self.run)();
        NOTES.with(|n| n.take())
    }
}

thread_local! {
    static NOTES: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
}

/// Says what a check leaves out on this device and why: on stderr (what
/// `cargo test --nocapture` shows) and in the check's outcome.
pub fn note(message: impl Into<String>) {
    let message = message.into();
    eprintln!("note: {message}");
    NOTES.with(|n| n.borrow_mut().push(message));
}

/// `register![a, b, ...]` at the end of a test module: its checks, as the
/// module's `CHECKS`.
macro_rules! register {
    ($($name:ident),* $(,)?) => {
        pub(crate) const CHECKS: &[crate::kernels::checks::Check] = &[$(
            crate::kernels::checks::Check::new(
                concat!(module_path!(), "::", stringify!($name)),
                $name,
            )
        ),*];
    };
}
pub(crate) use register;

/// Every kernel check, module by module.
pub fn all() -> Vec<&'static Check> {
    use super::*;
    [
        attention::tests::CHECKS,
        attn_weights::tests::CHECKS,
        key_scores::tests::CHECKS,
        query_scores::tests::CHECKS,
        compact::tests::CHECKS,
        embed::tests::CHECKS,
        epikv_delta::tests::CHECKS,
        head_norm::tests::CHECKS,
        matmul::tests::CHECKS,
        paging::tests::CHECKS,
        prepared_x::tests::CHECKS,
        random_fill::tests::CHECKS,
        read_bandwidth::tests::CHECKS,
        rmsnorm::tests::CHECKS,
        rope_kv::tests::CHECKS,
        runtime::tests::CHECKS,
        sample::tests::CHECKS,
        silu_mul::tests::CHECKS,
        token_logit::tests::CHECKS,
        variants::tests::CHECKS,
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// The kernel tests that are not checks, and why: they need what a browser
/// page lacks.
pub const NATIVE_ONLY: &[(&str, &str)] = &[(
    "kernels::checks::tests::every_kernel_test_is_a_check",
    "reads the sources",
)];

#[cfg(test)]
mod tests {
    use super::*;

    /// Every test under src/kernels is a check (`#[cfg_attr(test, test)]`
    /// and in its module's `register!`) or listed in [`NATIVE_ONLY`] (a
    /// plain `#[test]`); every check is a test and named once.
    #[test]
    fn every_kernel_test_is_a_check() {
        let checks: Vec<&str> = all().iter().map(|c| c.name()).collect();
        let mut seen = std::collections::HashSet::new();
        for name in &checks {
            assert!(seen.insert(*name), "{name} is registered twice");
        }
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/kernels");
        let mut tests = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let module = path.file_stem().unwrap().to_str().unwrap().to_string();
            let src = std::fs::read_to_string(&path).unwrap();
            let mut attribute = None;
            for line in src.lines().map(str::trim) {
                if line == "#[cfg_attr(test, test)]" || line == "#[test]" {
                    attribute = Some(line == "#[test]");
                } else if let (Some(plain), Some(rest)) = (attribute, line.strip_prefix("fn ")) {
                    let name = format!(
                        "kernels::{module}::tests::{}",
                        rest.split('(').next().unwrap()
                    );
                    let native_only = NATIVE_ONLY.iter().any(|(n, _)| *n == name);
                    if plain {
                        assert!(native_only, "{name} is a plain #[test]: make it a check (#[cfg_attr(test, test)], register!) or say in NATIVE_ONLY why not");
                    } else {
                        assert!(
                            checks.contains(&name.as_str()),
                            "{name} is not in its module's register!"
                        );
                    }
                    tests += 1;
                    attribute = None;
                }
            }
        }
        assert_eq!(tests, checks.len() + NATIVE_ONLY.len());
    }
}
