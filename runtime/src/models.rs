//! One loaded copy of a model's weights per device per process, shared by every stream and
//! every element instance that names the same file (as it is on disk: a file replaced since is
//! loaded anew); the same for projectors. Entries are weak: weights are freed when their last
//! owner drops them.

use std::collections::HashMap;
use std::hash::Hash;
use std::path::Path;
use std::sync::{Arc, LazyLock, Weak};

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::llama::{Device, FileId, Model, Projector, ProjectorKey};

/// A key's copy, and a lock held while it loads, so that two callers never load the same
/// weights twice while the registry's lock is held only to find the slot (a load of seconds
/// holds up neither other keys' loads nor `model_owners`).
struct Slot<V> {
    loading: Mutex<()>,
    copy: Mutex<Weak<V>>,
}

type Registry<K, V> = LazyLock<Mutex<HashMap<K, Arc<Slot<V>>>>>;

static MODELS: Registry<(FileId, Device), Model> = LazyLock::new(Default::default);
static PROJECTORS: Registry<ProjectorKey, Projector> = LazyLock::new(Default::default);

/// The copy of `key` in `registry`, loaded by `load` on first use.
fn shared<K: Eq + Hash, V>(registry: &Registry<K, V>, key: K, load: impl FnOnce() -> Result<V>) -> Result<Arc<V>> {
    let slot = {
        let mut slots = registry.lock();
        // (Kept: a slot someone holds, loading or about to, and one whose copy lives.)
        slots.retain(|_, s| Arc::strong_count(s) > 1 || s.copy.lock().strong_count() > 0);
        Arc::clone(
            slots.entry(key).or_insert_with(|| Arc::new(Slot { loading: Mutex::new(()), copy: Mutex::default() })),
        )
    };
    let _loading = slot.loading.lock();
    if let Some(v) = slot.copy.lock().upgrade() {
        return Ok(v);
    }
    let v = Arc::new(load()?);
    *slot.copy.lock() = Arc::downgrade(&v);
    Ok(v)
}

/// The shared model for `path` on `device`, loading it on first use.
pub fn model(path: &Path, device: &Device) -> Result<Arc<Model>> {
    let file = FileId::of(path);
    shared(&MODELS, (file.clone(), device.clone()), || {
        let model = Model::load(path, device)?;
        if *model.file() != file {
            return Err(Error::File {
                path: path.to_path_buf(),
                reason: "the file was replaced while it was being loaded: load it again".into(),
            });
        }
        Ok(model)
    })
}

/// A copy of the weights of `path` (the file there now) already loaded on any device (the CPU's
/// first), if any: what a projector needs of a language model (its vocabulary and width)
/// without loading another copy of the weights when every engine has its copy on the GPU.
pub fn any_loaded(path: &Path) -> Option<Arc<Model>> {
    let file = FileId::of(path);
    let copies: Vec<(Device, Arc<Model>)> = MODELS
        .lock()
        .iter()
        .filter(|((f, _), _)| *f == file)
        .filter_map(|((_, d), s)| s.copy.lock().upgrade().map(|m| (d.clone(), m)))
        .collect();
    copies.iter().find(|(d, _)| *d == Device::Cpu).or(copies.first()).map(|(_, m)| Arc::clone(m))
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
    let key = ProjectorKey { mmproj: FileId::of(mmproj), model: model.file().clone(), use_gpu };
    let p = shared(&PROJECTORS, key, || Projector::load(mmproj, Arc::clone(model), use_gpu, threads, contexts))?;
    p.ensure_contexts(contexts, threads)?;
    Ok(p)
}

/// How many owners hold loaded copies of the weights of `path`, on every device (0 when not
/// loaded): a statistic that shows weights are shared rather than copied.
pub fn model_owners(path: &Path) -> usize {
    let path = FileId::of(path).path;
    MODELS.lock().iter().filter(|((f, _), _)| f.path == path).map(|(_, s)| s.copy.lock().strong_count()).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A load in progress holds up neither another key's load nor a reader of the registry,
    /// and a second caller of the same key waits for it and gets its copy (no second load).
    #[test]
    fn a_load_holds_up_only_callers_of_its_own_key() {
        static TEST: Registry<u32, u32> = LazyLock::new(Default::default);
        let (entered, loading) = std::sync::mpsc::channel();
        let (release, held) = std::sync::mpsc::channel::<()>();
        let first = std::thread::spawn(move || {
            shared(&TEST, 1, || {
                entered.send(()).unwrap();
                held.recv().unwrap();
                Ok(10)
            })
        });
        loading.recv().unwrap();
        assert_eq!(*shared(&TEST, 2, || Ok(20)).unwrap(), 20, "another key loads meanwhile");
        assert_eq!(TEST.lock().len(), 2, "the registry is readable meanwhile");
        let again = std::thread::spawn(|| shared(&TEST, 1, || panic!("loaded twice")));
        release.send(()).unwrap();
        let (a, b) = (first.join().unwrap().unwrap(), again.join().unwrap().unwrap());
        assert!(Arc::ptr_eq(&a, &b));
    }
}
