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

/// Refuse a file that is not a libmtmd projector, or one whose wrapper tokens the model lacks.
pub fn check_projector(path: &Path, model: &Model) -> Result<()> {
    let bad = |reason: String| Error::File { path: path.to_path_buf(), reason };
    let gguf = GgufContext::from_file(path).ok_or_else(|| bad("not a GGUF file".into()))?;
    let arch = string_value(&gguf, "general.architecture").unwrap_or_default();
    if arch != "clip" {
        return Err(bad(format!("not a projector (mmproj) file: its architecture is {arch:?}, expected \"clip\"")));
    }
    let projector_type = string_value(&gguf, "clip.projector_type")
        .or_else(|| string_value(&gguf, "clip.vision.projector_type"))
        .ok_or_else(|| bad("projector file has no clip.projector_type".into()))?;
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
