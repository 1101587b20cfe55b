//! One loaded copy of a model's weights per device per process, shared by every stream and
//! every element instance that names the same file; the same for projectors. Entries are weak:
//! weights are freed when their last owner drops them.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Weak};

use parking_lot::Mutex;

use crate::error::Result;
use crate::llama::{Device, Model, Projector, ProjectorKey};

type Registry<K, V> = LazyLock<Mutex<HashMap<K, Weak<V>>>>;

static MODELS: Registry<(PathBuf, Device), Model> = LazyLock::new(Default::default);
static PROJECTORS: Registry<ProjectorKey, Projector> = LazyLock::new(Default::default);

fn canonical(path: &Path) -> PathBuf {
    std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf())
}

/// The shared model for `path` on `device`, loading it on first use.
pub fn model(path: &Path, device: &Device) -> Result<Arc<Model>> {
    let key = (canonical(path), device.clone());
    // The lock is held while loading so two callers never load the same weights twice.
    let mut models = MODELS.lock();
    if let Some(model) = models.get(&key).and_then(Weak::upgrade) {
        return Ok(model);
    }
    let model = Arc::new(Model::load(path, device)?);
    models.retain(|_, w| w.strong_count() > 0);
    models.insert(key, Arc::downgrade(&model));
    Ok(model)
}

/// A copy of the weights of `path` already loaded on any device (the CPU's first), if any: what
/// a projector needs of a language model (its vocabulary and width) without loading another
/// copy of the weights when every engine has its copy on the GPU.
pub fn any_loaded(path: &Path) -> Option<Arc<Model>> {
    let path = canonical(path);
    let models = MODELS.lock();
    let copies = || models.iter().filter(|((p, _), _)| *p == path);
    let cpu = copies().find(|((_, d), _)| *d == Device::Cpu).and_then(|(_, w)| w.upgrade());
    cpu.or_else(|| copies().find_map(|(_, w)| w.upgrade()))
}

/// The shared projector for `mmproj` bound to `model`, loading it on first use with `contexts`
/// encoder contexts sharing `threads` (a projector already loaded with fewer gains the rest).
pub fn projector(
    mmproj: &Path,
    model: &Arc<Model>,
    use_gpu: bool,
    threads: i32,
    contexts: usize,
) -> Result<Arc<Projector>> {
    let key = ProjectorKey { mmproj: canonical(mmproj), model: canonical(model.path()), use_gpu };
    let mut projectors = PROJECTORS.lock();
    if let Some(p) = projectors.get(&key).and_then(Weak::upgrade) {
        p.ensure_contexts(contexts, threads)?;
        return Ok(p);
    }
    let p = Arc::new(Projector::load(mmproj, Arc::clone(model), use_gpu, threads, contexts)?);
    projectors.retain(|_, w| w.strong_count() > 0);
    projectors.insert(key, Arc::downgrade(&p));
    Ok(p)
}

/// How many owners hold loaded copies of the weights of `path`, on every device (0 when not
/// loaded): a statistic that shows weights are shared rather than copied.
pub fn model_owners(path: &Path) -> usize {
    let path = canonical(path);
    MODELS.lock().iter().filter(|((p, _), _)| *p == path).map(|(_, w)| w.strong_count()).sum()
}
