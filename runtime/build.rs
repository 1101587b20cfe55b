//! `llama::kv_pages` mirrors two structs of ggml's private `ggml-backend-impl.h`:
//! `layout/kv_pages.c` checks their offsets against that header, as the llama.cpp that
//! llama-cpp-sys-2 builds has it (found through its cmake cache), and the hook is built in
//! (`cfg(kv_pages_layout)`) only when the header is found; a header that disagrees fails the
//! build.
//!
//! With the `rknn` feature and `VLM_RKNN_STANDIN=1` (machines without a Rockchip NPU, such as CI),
//! build `rknn-standin/librknnrt.c` as the librknnrt that rknn-rs links, and let this crate's
//! tests and examples find it at run time. On a Rockchip board leave VLM_RKNN_STANDIN unset: the
//! vendor's librknnrt is used.

fn main() {
    check_kv_pages_layout();
    println!("cargo:rerun-if-env-changed=VLM_RKNN_STANDIN");
    println!("cargo:rerun-if-changed=rknn-standin/librknnrt.c");
    if std::env::var_os("CARGO_FEATURE_RKNN").is_none() || std::env::var("VLM_RKNN_STANDIN").as_deref() != Ok("1") {
        return;
    }
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let compiler = cc::Build::new().get_compiler();
    let status = std::process::Command::new(compiler.path())
        .args(["-shared", "-fPIC", "-O2", "-o"])
        .arg(out.join("librknnrt.so"))
        .arg("rknn-standin/librknnrt.c")
        .arg("-lm")
        .status()
        .expect("run the C compiler");
    assert!(status.success(), "building the librknnrt stand-in failed");
    println!("cargo:rustc-link-search=native={}", out.display());
    println!("cargo:rustc-link-arg-tests=-Wl,-rpath,{}", out.display());
    println!("cargo:rustc-link-arg-examples=-Wl,-rpath,{}", out.display());
}

/// The llama.cpp source tree llama-cpp-sys-2 configured: `CMAKE_HOME_DIRECTORY` in the cmake
/// cache beside the ggml package it exports (`DEP_LLAMA_GGML_CMAKE_DIR` = OUT_DIR/lib/cmake).
fn llama_cpp_source() -> Option<std::path::PathBuf> {
    let cmake_dir = std::path::PathBuf::from(std::env::var_os("DEP_LLAMA_GGML_CMAKE_DIR")?);
    let cache = std::fs::read_to_string(cmake_dir.parent()?.parent()?.join("build/CMakeCache.txt")).ok()?;
    let source = cache.lines().find_map(|l| l.strip_prefix("CMAKE_HOME_DIRECTORY:INTERNAL="))?;
    Some(source.into())
}

fn check_kv_pages_layout() {
    println!("cargo:rustc-check-cfg=cfg(kv_pages_layout)");
    println!("cargo:rerun-if-changed=layout/kv_pages.c");
    let Some(ggml) = llama_cpp_source().map(|s| s.join("ggml")).filter(|g| g.join("src/ggml-backend-impl.h").is_file())
    else {
        println!(
            "cargo:warning=ggml-backend-impl.h not found: KV buffers are cleared by llama.cpp (resident from the start)"
        );
        return;
    };
    let compiler = cc::Build::new().get_compiler();
    let output = compiler
        .to_command()
        .arg("-fsyntax-only")
        .arg("-I")
        .arg(ggml.join("include"))
        .arg("-I")
        .arg(ggml.join("src"))
        .arg("layout/kv_pages.c")
        .output();
    let Ok(output) = output else {
        println!("cargo:warning=no C compiler to check ggml's buffer layout with: KV buffers are cleared by llama.cpp");
        return;
    };
    assert!(
        output.status.success(),
        "ggml's buffer structs changed (runtime/layout/kv_pages.c against {}): update `llama::kv_pages` and the check\n{}",
        ggml.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    println!("cargo:rustc-cfg=kv_pages_layout");
}
