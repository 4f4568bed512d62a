//! Gives our binaries and test executables an rpath to libtorch (tch's own link arguments apply
//! only to tch), so they run without LD_LIBRARY_PATH.

fn main() {
    if let Some(lib) = std::env::var_os("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.to_string_lossy());
    }
}
