//! Checks on a projector file before it is handed to libmtmd.
//!
//! llama.cpp aborts the whole process on some inputs instead of returning an error (an
//! `idefics3` projector with a vocabulary that lacks SmolVLM's image tokens hits a `GGML_ASSERT`
//! in mtmd's helper; a value of the wrong type asserts in the GGUF reader). A GStreamer element
//! must never take the application down, so what can be checked from metadata is checked here.

use std::path::Path;

use llama_cpp_2::gguf::GgufContext;
use llama_cpp_sys_2 as sys;

use super::Model;
use crate::error::{Error, Result};

/// Special tokens a projector type's wrapper text needs in the language model's vocabulary.
fn required_tokens(projector_type: &str) -> &'static [&'static str] {
    match projector_type {
        // libmtmd looks up "\n\n" as one token (`lookup_token`) before the overview image;
        // without it a -1 token id ends up in the frame's text.
        "idefics3" => &["\n\n", "<fake_token_around_image>", "<global-img>"],
        _ => &[],
    }
}

fn string_value(gguf: &GgufContext, key: &str) -> Option<String> {
    let idx = gguf.find_key(key);
    (idx >= 0 && gguf.kv_type(idx) == sys::GGUF_TYPE_STRING).then(|| gguf.val_str(idx).map(str::to_owned)).flatten()
}

/// The vision projector type in a projector file's metadata (`clip.projector_type`, else
/// `clip.vision.projector_type`), as libmtmd reads it.
fn projector_type_in(gguf: &GgufContext) -> Option<String> {
    string_value(gguf, "clip.projector_type").or_else(|| string_value(gguf, "clip.vision.projector_type"))
}

/// The vision projector type of a projector file ([`projector_type_in`]).
pub fn projector_type(path: &Path) -> Result<String> {
    let bad = |reason: &str| Error::File { path: path.to_path_buf(), reason: reason.into() };
    let gguf = GgufContext::from_file(path).ok_or_else(|| bad("not a GGUF file"))?;
    projector_type_in(&gguf).ok_or_else(|| bad("projector file has no clip.projector_type"))
}

fn u32_value(gguf: &GgufContext, key: &str) -> Option<u32> {
    let idx = gguf.find_key(key);
    (idx >= 0 && gguf.kv_type(idx) == sys::GGUF_TYPE_UINT32).then(|| gguf.val_u32(idx))
}

/// A tiled (`idefics3`: SmolVLM) projector's tiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TileGeometry {
    /// A tile's side (`clip.vision.image_size`).
    pub tile: u32,
    /// The longest edge the preprocessor resizes a picture to (`clip.vision.preproc_image_size`).
    pub longest_edge: u32,
    /// The rows a tile becomes: (tile / (patch × pixel-shuffle factor))², where the file names the
    /// factor (`clip.vision.patch_size`, `clip.vision.projector.scale_factor`).
    pub tokens: Option<usize>,
}

/// A tiled projector's [`TileGeometry`]; `None` for other projector types or a file without a
/// longest edge.
pub fn tile_geometry(path: &Path) -> Option<TileGeometry> {
    let gguf = GgufContext::from_file(path)?;
    if projector_type_in(&gguf)? != "idefics3" {
        return None;
    }
    let tile = u32_value(&gguf, "clip.vision.image_size")?;
    let longest_edge = u32_value(&gguf, "clip.vision.preproc_image_size")?;
    let side = || {
        let step =
            u32_value(&gguf, "clip.vision.patch_size")? * u32_value(&gguf, "clip.vision.projector.scale_factor")?;
        (step > 0 && tile % step == 0).then_some((tile / step) as usize)
    };
    let tokens = side().map(|n| n * n);
    (tile > 0 && longest_edge > 0).then_some(TileGeometry { tile, longest_edge, tokens })
}

/// libmtmd's rule for whether the images of a projector type attend to each other (decoded
/// whole, non-causally): `mtmd_decode_use_non_causal` in tools/mtmd/mtmd.cpp of the pinned
/// llama.cpp. `n_embd` is the projector's output width (the language model's input width):
/// Gemma 4's E2B and E4B (1536, 2560) decode images causally.
pub fn projector_type_non_causal(projector_type: &str, n_embd: usize) -> bool {
    match projector_type {
        "gemma4v" => n_embd != 1536 && n_embd != 2560,
        "gemma3" | "gemma4uv" | "deepseek4v" => true,
        _ => false,
    }
}

/// The vision projector types llama.cpp's converter writes beside a language model of
/// architecture `arch`, for the families libmtmd's rule names (conversion/gemma.py:
/// Gemma3VisionModel, Gemma4VisionAudioModel, Gemma4UnifiedVisionAudioModel;
/// conversion/deepseek.py: DeepseekV4FlashVisionModel).
pub fn paired_projector_types(arch: &str) -> &'static [&'static str] {
    match arch {
        "gemma3" => &["gemma3"],
        "gemma4" => &["gemma4v", "gemma4uv"],
        "deepseek4" => &["deepseek4v"],
        _ => &[],
    }
}

/// Refuse a file that is not a libmtmd projector, or one whose wrapper tokens the model lacks.
pub fn check_projector(path: &Path, model: &Model) -> Result<()> {
    let bad = |reason: String| Error::File { path: path.to_path_buf(), reason };
    let gguf = GgufContext::from_file(path).ok_or_else(|| bad("not a GGUF file".into()))?;
    let arch = string_value(&gguf, "general.architecture").unwrap_or_default();
    if arch != "clip" {
        return Err(bad(format!("not a projector (mmproj) file: its architecture is {arch:?}, expected \"clip\"")));
    }
    let projector_type =
        projector_type_in(&gguf).ok_or_else(|| bad("projector file has no clip.projector_type".into()))?;
    for token in required_tokens(&projector_type) {
        if !model.has_special_token(token) {
            return Err(bad(format!(
                "projector type {projector_type} needs the token {token:?} that the language model {} does not have",
                model.path().display()
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{paired_projector_types, projector_type_non_causal};

    /// Which images libmtmd decodes non-causally comes from the projector type (libmtmd's list),
    /// and a language model is matched to the projector types that pair with it.
    #[test]
    fn non_causal_images_follow_libmtmds_projector_types() {
        for (ty, n_embd, non_causal) in [
            ("gemma3", 2560, true),
            ("gemma4uv", 1536, true),
            ("deepseek4v", 4096, true),
            ("gemma4v", 5376, true),
            ("gemma4v", 1536, false),
            ("gemma4v", 2560, false),
            ("idefics3", 576, false),
            ("mlp", 576, false),
            ("qwen2vl_merger", 1536, false),
        ] {
            assert_eq!(projector_type_non_causal(ty, n_embd), non_causal, "{ty} at {n_embd}");
        }
        let refused =
            |arch: &str, n_embd| paired_projector_types(arch).iter().any(|t| projector_type_non_causal(t, n_embd));
        assert!(refused("gemma3", 640));
        assert!(refused("gemma4", 5376));
        assert!(refused("gemma4", 1536), "a Gemma 4 E2B may come with the unified (non-causal) projector");
        assert!(refused("deepseek4", 4096));
        assert!(!refused("llama", 576));
        assert!(!refused("qwen2vl", 1536));
    }
}
