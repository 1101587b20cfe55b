//! Tile reuse (`FrameEncoder::encode_reusing`) on a tiled projector: the idefics3 test pair
//! (64 px tiles, longest edge 128: a 64x48 frame is 2x2 tiles and an overview). A change in one
//! corner encodes that tile and the overview; the other tiles come from the frame before, and
//! equal what a full encode of the new pixels gives.

mod common;

use std::sync::Arc;

use vlm_runtime::encoder::gate::{ChangeGate, Decision};
use vlm_runtime::encoder::{Encoded, FrameEncoder, MtmdEncoder, Picture, PixelLayout, TileReuse};
use vlm_runtime::llama::{Segment, Tile, Turn};
use vlm_runtime::{Device, Frame, models};

const W: u32 = 64;
const H: u32 = 48;

fn encoder(family: &str) -> FrameEncoder {
    // No embedding cache: every frame goes to the encoder.
    encoder_cached(family, 0)
}

/// With an embedding cache of `entries` frames.
fn encoder_cached(family: &str, entries: usize) -> FrameEncoder {
    let dir = common::models_dir();
    let (lm, mmproj) = (dir.join(format!("test-{family}-lm.gguf")), dir.join(format!("test-{family}-mmproj.gguf")));
    let model = models::model(&lm, &Device::Cpu).expect("model");
    let projector = models::projector(&mmproj, &model, false, 2, 1).expect("projector");
    FrameEncoder::new(Arc::new(MtmdEncoder::new(projector)), entries, usize::MAX)
}

fn picture(rgb: &[u8]) -> Picture<'_> {
    Picture::packed(rgb, W, H, W as usize * 3, PixelLayout::Rgb)
}

/// common::picture(0) with a white square of `side` px at (x, y).
fn with_square(x: u32, y: u32, side: u32) -> Vec<u8> {
    let mut rgb = common::picture(0);
    for yy in y..y + side {
        for xx in x..x + side {
            let at = ((yy * W + xx) * 3) as usize;
            rgb[at..at + 3].fill(255);
        }
    }
    rgb
}

/// common::picture(0) with its top-left 20x20 pixels a little brighter: under the gate's noise
/// floor.
fn nearly() -> Vec<u8> {
    let mut rgb = common::picture(0);
    for y in 0..20 {
        for x in 0..20 {
            let at = ((y * W + x) * 3) as usize;
            rgb[at..at + 3].iter_mut().for_each(|v| *v = v.saturating_add(10));
        }
    }
    rgb
}

/// Encode `rgb` as vlmencode does with tile-reuse=threshold: sampled by `gate`, then reusing
/// what the gate saw unchanged.
fn encode_on_threshold(enc: &FrameEncoder, gate: &mut ChangeGate, rgb: &[u8]) -> Encoded {
    let luma = match gate.decide(&picture(rgb), 0.0001).unwrap() {
        Decision::Changed(_, l) | Decision::Unchanged(_, l) => Arc::new(l),
    };
    gate.encoded(Arc::clone(&luma));
    enc.encode_reusing(&picture(rgb), TileReuse::Unchanged(&luma), Turn::default()).unwrap()
}

fn image_rows(segments: &[Segment]) -> Vec<&[f32]> {
    segments
        .iter()
        .filter_map(|s| match s {
            Segment::Image(i) => Some(&*i.data),
            Segment::Text(_) => None,
        })
        .collect()
}

fn images(frame: &Frame) -> Vec<&[f32]> {
    image_rows(&frame.segments)
}

#[test]
fn a_changed_corner_encodes_its_tile_and_the_overview_and_reuses_the_rest_exactly() {
    let enc = encoder("idefics3");
    let a = common::picture(0);
    let first = enc.encode_reusing(&picture(&a), TileReuse::Exact, Turn::default()).unwrap();
    let cell = |row, col| Some(Tile::Cell { row, col, rows: 2, cols: 2 });
    assert_eq!(first.tiles.tiles, [cell(1, 1), cell(1, 2), cell(2, 1), cell(2, 2), Some(Tile::Whole)]);
    assert_eq!((first.tiles.encoded, first.tiles.reused), (5, 0));
    // A square well inside the top-left tile (0..32 x 0..24).
    let b = with_square(4, 4, 12);
    let second = enc.encode_reusing(&picture(&b), TileReuse::Exact, Turn::default()).unwrap();
    assert_eq!((second.tiles.encoded, second.tiles.reused), (2, 3));
    // What a full encode of the new pixels gives, tile for tile, bit for bit.
    let fresh = encoder("idefics3").encode_reusing(&picture(&b), TileReuse::Off, Turn::default()).unwrap();
    assert_eq!((fresh.tiles.encoded, fresh.tiles.reused), (5, 0));
    assert_eq!(images(&second.frame), images(&fresh.frame));
    assert_ne!(images(&second.frame)[0], images(&first.frame)[0], "the changed tile is new");
    // After forget_last (a flush, new caps), nothing is reused.
    enc.forget_last();
    let third = enc.encode_reusing(&picture(&b), TileReuse::Exact, Turn::default()).unwrap();
    assert_eq!((third.tiles.encoded, third.tiles.reused), (5, 0));
}

#[test]
fn threshold_reuse_follows_the_gate_from_the_pixels_a_tile_was_encoded_from() {
    let enc = encoder("idefics3");
    let mut gate = ChangeGate::default();
    // (encoded, reused)
    let mut encode = |rgb: &[u8]| {
        let e = encode_on_threshold(&enc, &mut gate, rgb);
        (e.tiles.encoded, e.tiles.reused)
    };
    assert_eq!(encode(&common::picture(0)), (5, 0));
    // The square appears in the top-left tile, then moves to the bottom-right one.
    assert_eq!(encode(&with_square(4, 4, 12)), (2, 3));
    assert_eq!(encode(&with_square(48, 32, 14)), (3, 2), "its old place and its new one, and the overview");
    // The same picture again: every tile from before; the overview, the whole picture, is the
    // change gate's to hold or encode (here it lets the frame through: min-change is tiny).
    assert_eq!(encode(&with_square(48, 32, 14)), (1, 4));
}

/// A frame given reused tiles (rows of pixels within the threshold, not its own) is not cached
/// under its own pixels: after a flush, or with reuse off, the same picture is encoded afresh
/// (it came back from the cache with the older tiles' rows).
#[test]
fn a_frame_with_reused_tiles_is_not_cached_as_its_own_encode() {
    let enc = encoder_cached("idefics3", 16);
    let mut gate = ChangeGate::default();
    let nearly = nearly();
    assert!(!encode_on_threshold(&enc, &mut gate, &common::picture(0)).hit);
    let e = encode_on_threshold(&enc, &mut gate, &nearly);
    assert!(!e.hit);
    assert!(e.tiles.reused > 0, "the brighter tile is taken from the frame before: {:?}", e.tiles);
    enc.forget_last();
    let again = enc.encode_reusing(&picture(&nearly), TileReuse::Off, Turn::default()).unwrap();
    assert!(!again.hit, "a frame with reused tiles came back from the cache");
    let fresh = encoder("idefics3").encode_reusing(&picture(&nearly), TileReuse::Off, Turn::default()).unwrap();
    assert_eq!(images(&again.frame), images(&fresh.frame));
    // A full encode is cached.
    assert!(enc.encode_reusing(&picture(&nearly), TileReuse::Off, Turn::default()).unwrap().hit);
}

/// Exact reuse hands on only rows encoded from a frame's own pixels: a tile whose rows were
/// taken on the threshold from an older frame is encoded again when an exact pass (a refresh
/// after `max-unchanged`, or `tile-reuse=exact`) sees its pixels unchanged since.
#[test]
fn exact_reuse_never_passes_on_rows_taken_on_the_threshold() {
    let enc = encoder("idefics3");
    let mut gate = ChangeGate::default();
    let nearly = nearly();
    encode_on_threshold(&enc, &mut gate, &common::picture(0));
    encode_on_threshold(&enc, &mut gate, &nearly);
    let exact = enc.encode_reusing(&picture(&nearly), TileReuse::Exact, Turn::default()).unwrap();
    let fresh = encoder("idefics3").encode_reusing(&picture(&nearly), TileReuse::Off, Turn::default()).unwrap();
    assert_eq!(images(&exact.frame), images(&fresh.frame), "rows of other pixels passed on as exact");
    assert!(exact.tiles.reused > 0, "the tiles encoded from these pixels are still reused: {:?}", exact.tiles);
}

/// A change just beyond a tile's edge reaches into it through the resize (Lanczos-3, enlarged
/// 2x here): exact reuse sees it and encodes the tile again.
#[test]
fn exact_reuse_sees_a_change_the_resize_blends_in_from_beside_the_tile() {
    let enc = encoder("idefics3");
    enc.encode_reusing(&picture(&common::picture(0)), TileReuse::Exact, Turn::default()).unwrap();
    // The top-left tile is 0..32 x 0..24: a square from x = 34.
    let b = with_square(34, 4, 12);
    let exact = enc.encode_reusing(&picture(&b), TileReuse::Exact, Turn::default()).unwrap();
    let fresh = encoder("idefics3").encode_reusing(&picture(&b), TileReuse::Off, Turn::default()).unwrap();
    assert_eq!(images(&exact.frame), images(&fresh.frame));
}

#[test]
fn a_projector_without_tiles_encodes_the_picture_whole() {
    let enc = encoder("qwen2vl");
    let a = common::picture(0);
    let first = enc.encode_reusing(&picture(&a), TileReuse::Exact, Turn::default()).unwrap();
    let second = enc.encode_reusing(&picture(&a), TileReuse::Exact, Turn::default()).unwrap();
    assert_eq!(first.tiles.tiles, [Some(Tile::Whole)]);
    // The same pixels: the one image is reused whole.
    assert_eq!((second.tiles.encoded, second.tiles.reused), (0, 1));
    let b = with_square(4, 4, 12);
    let third = enc.encode_reusing(&picture(&b), TileReuse::Exact, Turn::default()).unwrap();
    assert_eq!((third.tiles.encoded, third.tiles.reused), (1, 0));
}

#[test]
fn several_encoder_contexts_give_the_rows_of_one_for_a_frames_tiles_and_for_frames_side_by_side() {
    let dir = common::models_dir();
    let (lm, mmproj) = (dir.join("test-idefics3-lm.gguf"), dir.join("test-idefics3-mmproj.gguf"));
    let model = models::model(&lm, &Device::Cpu).expect("model");
    // Private projectors (not the shared registry's), one CPU thread per context either way.
    let one = Arc::new(vlm_runtime::llama::Projector::load(&mmproj, Arc::clone(&model), false, 1, 1).unwrap());
    let three = Arc::new(vlm_runtime::llama::Projector::load(&mmproj, Arc::clone(&model), false, 3, 3).unwrap());
    assert_eq!((one.contexts(), three.contexts()), (1, 3));
    let rows =
        |segments: &[Segment]| -> Vec<Vec<f32>> { image_rows(segments).into_iter().map(<[f32]>::to_vec).collect() };
    let pictures: Vec<Vec<u8>> = (0..4).map(|i| with_square(4 + 8 * i, 4 + 4 * i, 12)).collect();
    let reference: Vec<_> = pictures
        .iter()
        .map(|p| {
            let (segments, count) = one.encode_tiles(p, W, H, &mut |_, _| None, Turn::default()).unwrap();
            assert_eq!((count.encoded, count.contexts), (5, 1));
            rows(&segments)
        })
        .collect();
    // One frame alone: its 5 tiles spread over the 3 contexts, the same rows bit for bit.
    let (segments, count) = three.encode_tiles(&pictures[0], W, H, &mut |_, _| None, Turn::default()).unwrap();
    assert_eq!((count.encoded, count.contexts), (5, 3));
    assert_eq!(rows(&segments), reference[0]);
    // Four frames at once on the 3 contexts: each frame's own rows.
    std::thread::scope(|s| {
        let threads: Vec<_> = pictures
            .iter()
            .map(|p| s.spawn(|| three.encode_tiles(p, W, H, &mut |_, _| None, Turn::default()).unwrap()))
            .collect();
        for (i, t) in threads.into_iter().enumerate() {
            let (segments, count) = t.join().unwrap();
            assert_eq!(count.encoded, 5);
            assert!((1..=3).contains(&count.contexts), "{count:?}");
            assert_eq!(rows(&segments), reference[i], "frame {i}");
        }
    });
    // A reused tile is not encoded, and a frame with nothing to encode uses no context.
    let (_, count) = three
        .encode_tiles(&pictures[1], W, H, &mut |_, n| Some(vec![0.0; n * model.n_embd()].into()), Turn::default())
        .unwrap();
    assert_eq!((count.encoded, count.reused, count.contexts), (0, 5, 0));
}

#[test]
fn a_projectors_encoder_contexts_share_one_copy_of_its_weights_while_the_file_is_unchanged() {
    let dir = common::models_dir();
    let model = models::model(&dir.join("test-idefics3-lm.gguf"), &Device::Cpu).expect("model");
    // A file of this test's own: other tests load the original meanwhile.
    let tmp = std::env::temp_dir().join(format!("vlm-shared-weights-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let mmproj = tmp.join("mmproj.gguf");
    std::fs::copy(dir.join("test-idefics3-mmproj.gguf"), &mmproj).unwrap();
    let copies = || vlm_runtime::llama::Projector::weight_copies(&mmproj).unwrap();
    let load = |contexts: usize| {
        vlm_runtime::llama::Projector::load(&mmproj, Arc::clone(&model), false, contexts as i32, contexts).map(Arc::new)
    };
    assert_eq!(copies(), (0, 0));
    let three = load(3).unwrap();
    assert_eq!(copies(), (1, 3), "three contexts, one copy of the weights");
    // Another projector of the file, named through a link, reads the same copy.
    let link = tmp.join("link.gguf");
    std::os::unix::fs::symlink(&mmproj, &link).unwrap();
    let one = vlm_runtime::llama::Projector::load(&link, Arc::clone(&model), false, 1, 1).map(Arc::new).unwrap();
    assert_eq!(copies(), (1, 4), "another projector of the file reads the same copy");
    let rows = |p: &Arc<vlm_runtime::llama::Projector>| -> Vec<Vec<f32>> {
        let segments = p.encode(&with_square(4, 4, 12), W, H).unwrap();
        image_rows(&segments).into_iter().map(<[f32]>::to_vec).collect()
    };
    let before = rows(&three);
    // The projector that loaded the weights goes; the other still reads them, unchanged.
    drop(three);
    assert_eq!(copies(), (1, 1));
    assert_eq!(rows(&one), before);
    let shared = models::projector(&mmproj, &model, false, 1, 1).unwrap();
    // A file replaced since (a new one renamed over it) is loaded anew (its weights may differ),
    // beside the copy still read, and a projector of the old file gains no context from the new.
    std::fs::copy(dir.join("test-idefics3-mmproj.gguf"), tmp.join("new.gguf")).unwrap();
    std::fs::rename(tmp.join("new.gguf"), &mmproj).unwrap();
    let rewritten = load(1).unwrap();
    assert_eq!(copies(), (2, 3));
    let err = one.ensure_contexts(2, 2).unwrap_err().to_string();
    assert!(err.contains("changed on disk"), "{err}");
    assert_eq!((one.contexts(), one.load_failed()), (1, true));
    let again = models::projector(&mmproj, &model, false, 1, 1).unwrap();
    assert!(!Arc::ptr_eq(&shared, &again), "the registry loads the new file");
    drop((one, rewritten, shared, again));
    assert_eq!(copies(), (0, 0), "the last context to go frees the weights");
    let _ = std::fs::remove_dir_all(&tmp);
}

/// A frame's segments as plain data: each text's tokens, each image's rows and positions.
fn segments_of(segments: &[Segment]) -> Vec<(Vec<i32>, Vec<f32>, i32)> {
    segments
        .iter()
        .map(|s| match s {
            Segment::Text(tokens) => (tokens.clone(), vec![], 0),
            Segment::Image(i) => (vec![], i.data.to_vec(), i.n_pos),
        })
        .collect()
}

/// Resized here (before libmtmd) and then cut into tiles here (each tile prepared alone, once
/// libmtmd has prepared a picture of that size), a picture gives the segments libmtmd's own
/// preparation gives, bit for bit.
#[test]
fn a_picture_resized_and_cut_here_gives_libmtmds_own_tiles_bit_for_bit() {
    let dir = common::models_dir();
    let (lm, mmproj) = (dir.join("test-idefics3-lm.gguf"), dir.join("test-idefics3-mmproj.gguf"));
    let model = models::model(&lm, &Device::Cpu).expect("model");
    // Two encoder contexts: the second prepares the tiles of a picture cut here.
    let projector = Arc::new(vlm_runtime::llama::Projector::load(&mmproj, model, false, 2, 2).unwrap());
    assert!(projector.resizes_pictures(), "the idefics3 pair's pictures are resized before libmtmd");
    let encode = |rgb: &[u8], w: u32, h: u32| {
        let (segments, count) = projector.encode_tiles(rgb, w, h, &mut |_, _| None, Turn::default()).unwrap();
        (segments_of(&segments), count.cut)
    };
    // Up (both edges, then to whole tiles), portrait, down, odd sizes, and already whole tiles.
    for (w, h) in [(64, 48), (48, 90), (300, 200), (37, 23), (128, 128), (131, 64)] {
        let rgb: Vec<u8> = (0..w * h * 3).map(|i| ((i * 7919) ^ (i / 3 * 31)) as u8).collect();
        projector.set_prepare_threads(0);
        let (libmtmd, cut) = encode(&rgb, w, h);
        assert!(!cut, "with no prepare threads libmtmd prepares the whole picture");
        for threads in [1, 3] {
            projector.set_prepare_threads(threads);
            // The first picture of a size may be prepared whole; the next one is cut.
            for call in 0..2 {
                let (segments, cut) = encode(&rgb, w, h);
                assert!(cut || call == 0, "{w}x{h}, {threads} thread(s): a picture of a size seen before is cut");
                // (Not assert_eq: a failure would print every row of the frame.)
                assert!(
                    segments == libmtmd,
                    "{w}x{h} on {threads} thread(s), cut {cut}: other segments than libmtmd's own"
                );
            }
        }
    }
}

#[test]
fn a_picture_too_narrow_for_the_longest_edge_is_refused_with_a_reason() {
    // Longest edge 128: a 300x1 line (or a 1x300 column) would be resized to 128x0.
    let enc = encoder("idefics3");
    for (w, h) in [(300u32, 1u32), (1, 300)] {
        let rgb = vec![128u8; (w * h * 3) as usize];
        let err = enc
            .encode_reusing(
                &Picture::packed(&rgb, w, h, w as usize * 3, PixelLayout::Rgb),
                TileReuse::Off,
                Turn::default(),
            )
            .map(|_| ())
            .expect_err("a picture resized to nothing");
        assert!(err.to_string().contains("at most 128:1"), "{w}x{h}: {err}");
    }
    // Within the ratio it encodes.
    let rgb = vec![128u8; 256 * 2 * 3];
    enc.encode_reusing(&Picture::packed(&rgb, 256, 2, 256 * 3, PixelLayout::Rgb), TileReuse::Off, Turn::default())
        .expect("a 128:1 picture");
}
