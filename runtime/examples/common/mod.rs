//! What the examples share: the model files (`VLM_MODEL` / `VLM_MMPROJ` override the defaults).

#[derive(clap::Args)]
pub struct ModelArgs {
    #[arg(long, env = "VLM_MODEL", default_value = "models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    pub model: std::path::PathBuf,
    #[arg(long, env = "VLM_MMPROJ", default_value = "models/test-mmproj-mlp.gguf")]
    pub mmproj: std::path::PathBuf,
}

/// The median of `v` (sorted in place).
#[allow(dead_code)] // not every example takes medians
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
