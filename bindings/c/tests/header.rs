//! include/sieve.h is what cbindgen makes of src/lib.rs today: a change to
//! the API that did not regenerate the header fails here.
//! `SIEVE_BLESS=1 cargo test -p sieve-c --test header` rewrites it.

use std::path::Path;

#[test]
fn the_committed_header_is_current() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut generated = vec![];
    cbindgen::Builder::new()
        .with_crate(dir)
        .with_config(config)
        .generate()
        .expect("cbindgen generates the header")
        .write(&mut generated);
    let path = dir.join("include/sieve.h");
    if std::env::var_os("SIEVE_BLESS").is_some() {
        std::fs::write(&path, &generated).unwrap();
        return;
    }
    let committed = std::fs::read(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "{} is not what cbindgen makes of src/lib.rs: run SIEVE_BLESS=1 cargo test -p sieve-c --test header",
        path.display()
    );
}
