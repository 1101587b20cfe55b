//! With the `rknn` feature and `VLM_RKNN_STANDIN=1` (machines without a Rockchip NPU, such as CI),
//! build `rknn-standin/librknnrt.c` as the librknnrt that rknn-rs links, and let this crate's
//! tests and examples find it at run time. On a Rockchip board leave VLM_RKNN_STANDIN unset: the
//! vendor's librknnrt is used.

fn main() {
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
