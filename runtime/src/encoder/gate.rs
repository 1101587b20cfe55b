//! The change gate: whether a frame differs enough from the last encoded one to be worth a
//! vision encode.
//!
//! The picture is cut into blocks (at least 16 px, at most 64 across) and its brightness
//! sampled (every other pixel each way). A sample has moved when it differs from the reference
//! frame's by more than `STEP_LEVELS` (of 255); a block has changed when its moved samples lean
//! one way, brighter or darker, by more than chance allows: `|up - down| >= MIN_SAMPLES` and
//! `|up - down| > K · √(4/3 · (up + down))`. Sensor noise, dither and a videotestsrc noise patch
//! move samples both ways at random (the difference of the two counts stays within a few √ of
//! their sum); an object that appears, leaves or moves makes its samples all brighter or all
//! darker. The frame's change is the share of its blocks that changed.
//!
//! What it cannot see: an object of less than about 10 × 10 pixels, a change of less than
//! `STEP_LEVELS` in brightness (a grey object on a grey ground), a change of colour at the same
//! brightness, and an object that moves within one block so that as much of the block gets
//! brighter as darker (it is seen once it enters another block). A slow drift of light adds up
//! against the last *encoded* frame until it shows, and the caller caps how long a picture may
//! stand unchanged.

use std::sync::Arc;

use super::{Picture, PixelFormat};

/// Smallest side of a block, in pixels.
const MIN_BLOCK: u32 = 16;
/// Most blocks across the longer side.
const MAX_BLOCKS_ACROSS: u32 = 64;
/// Pixels sampled per block side: every `STEP`th pixel in each direction.
const STEP: usize = 2;
/// A sample has moved when its brightness differs by more than this (of 255).
const STEP_LEVELS: i16 = 24;
/// A block has changed when more of its samples moved one way than the other by at least
/// this many...
const MIN_SAMPLES: u32 = 8;
/// ... and by more than this many standard deviations of that difference under noise.
const K: f64 = 4.0;

/// The sampled brightness of a picture, compared by [`ChangeGate`].
#[derive(Debug, Clone, PartialEq)]
pub struct Luma {
    width: u32,
    height: u32,
    /// Sampled columns and rows.
    cols: usize,
    rows: usize,
    /// rows × cols samples, row-major.
    samples: Vec<u8>,
}

impl Luma {
    /// Sample the brightness of `picture` (every [`STEP`]th pixel each way): the Y plane of
    /// YUV, (R + 2G + B) / 4 of packed RGB. `None` when the planes are too small for the size.
    pub fn of(picture: &Picture<'_>) -> Option<Luma> {
        let (w, h) = (picture.width as usize, picture.height as usize);
        if w == 0 || h == 0 {
            return None;
        }
        let (cols, rows) = (w.div_ceil(STEP), h.div_ceil(STEP));
        let (plane, stride) = (picture.planes[0], picture.strides[0]);
        let bpp = match picture.format {
            PixelFormat::Packed(layout) => layout.bytes_per_pixel(),
            PixelFormat::Nv12(_) | PixelFormat::I420(_) => 1,
        };
        if stride < w * bpp || plane.len() < stride * (h - 1) + w * bpp {
            return None;
        }
        let mut samples = Vec::with_capacity(cols * rows);
        for y in (0..h).step_by(STEP) {
            let row = &plane[y * stride..];
            match picture.format {
                PixelFormat::Packed(layout) => {
                    let [r, g, b] = layout.rgb_offsets();
                    for x in (0..w).step_by(STEP) {
                        let px = &row[x * bpp..];
                        samples.push(((px[r] as u16 + 2 * px[g] as u16 + px[b] as u16) / 4) as u8);
                    }
                }
                _ => samples.extend(row[..w].iter().step_by(STEP)),
            }
        }
        Some(Luma { width: picture.width, height: picture.height, cols, rows, samples })
    }
}

/// How a frame compares with the reference.
#[derive(Debug, Clone, PartialEq)]
pub struct Change {
    /// Blocks that changed, and blocks in all.
    pub blocks: usize,
    pub of: usize,
    /// Which blocks changed: `across` × (of / across), row-major, each `block` pixels square.
    map: Vec<bool>,
    across: usize,
    block: u32,
}

impl Change {
    /// The share of the picture (of its blocks) that changed, 0..1.
    pub fn share(&self) -> f64 {
        if self.of == 0 { 1.0 } else { self.blocks as f64 / self.of as f64 }
    }

    /// Whether a block inside pixels (x0, y0)..(x1, y1), or within `margin` pixels of them,
    /// changed.
    pub fn changed_in(&self, (x0, y0, x1, y1): (u32, u32, u32, u32), margin: u32) -> bool {
        let b = self.block;
        let rows = self.map.len() / self.across.max(1);
        let (bx0, by0) = ((x0.saturating_sub(margin) / b) as usize, (y0.saturating_sub(margin) / b) as usize);
        let (bx1, by1) =
            (((x1 + margin).div_ceil(b) as usize).min(self.across), ((y1 + margin).div_ceil(b) as usize).min(rows));
        (by0..by1).any(|y| (bx0..bx1).any(|x| self.map[y * self.across + x]))
    }
}

/// Compare two samplings of pictures of one size. `None` when the sizes differ (a new
/// geometry is a change in full).
pub fn compare(reference: &Luma, now: &Luma) -> Option<Change> {
    if (reference.width, reference.height) != (now.width, now.height) {
        return None;
    }
    let long = reference.width.max(reference.height);
    let block = MIN_BLOCK.max(long.div_ceil(MAX_BLOCKS_ACROSS)) as usize;
    // A block in samples.
    let side = block.div_ceil(STEP);
    let (bx, by) = (now.cols.div_ceil(side), now.rows.div_ceil(side));
    // (samples that got brighter, that got darker) per block
    let mut moved = vec![(0u32, 0u32); bx * by];
    for (y, (a, b)) in reference.samples.chunks(now.cols).zip(now.samples.chunks(now.cols)).enumerate() {
        let row = &mut moved[(y / side) * bx..][..bx];
        for (x, (&a, &b)) in a.iter().zip(b).enumerate() {
            let d = b as i16 - a as i16;
            if d > STEP_LEVELS {
                row[x / side].0 += 1;
            } else if d < -STEP_LEVELS {
                row[x / side].1 += 1;
            }
        }
    }
    let map: Vec<bool> = moved.iter().map(|&(up, down)| block_changed(up, down)).collect();
    Some(Change { blocks: map.iter().filter(|&&c| c).count(), of: map.len(), map, across: bx, block: block as u32 })
}

/// Whether a block whose samples moved `up` and `down` has changed: they lean one way beyond
/// what random moves (noise) give. Against one reference frame the noise of that frame's own
/// samples leans too (a sample that was bright there can mostly get darker), which adds about
/// a third to the variance of the lean.
fn block_changed(up: u32, down: u32) -> bool {
    let lean = up.abs_diff(down);
    lean >= MIN_SAMPLES && lean as f64 > K * ((up + down) as f64 * 4.0 / 3.0).sqrt()
}

/// The gate of one stream: the sampling of the last frame let through, and the decision for
/// each new frame.
#[derive(Debug, Default)]
pub struct ChangeGate {
    reference: Option<Arc<Luma>>,
}

/// What the gate decided for a frame.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Encode it: the picture changed by `change` (`None`: no reference to compare with, or a
    /// new geometry). Pass its sampling to [`ChangeGate::encoded`] once it is encoded.
    Changed(Option<Change>, Luma),
    /// Nothing beyond the noise: the last encoded frame still stands for it (its sampling is
    /// there for a caller that encodes it all the same).
    Unchanged(Change, Luma),
}

impl ChangeGate {
    /// Decide for `picture`: changed when at least `min_change` of its blocks (and at least one
    /// block) changed since the reference. A picture that cannot be sampled counts as changed.
    pub fn decide(&self, picture: &Picture<'_>, min_change: f64) -> Option<Decision> {
        let now = Luma::of(picture)?;
        let change = self.reference.as_ref().and_then(|r| compare(r, &now));
        Some(match change {
            Some(c) if c.blocks < required_blocks(min_change, c.of) => Decision::Unchanged(c, now),
            _ => Decision::Changed(change, now),
        })
    }

    /// The frame sampled as `luma` is encoded: later frames compare with it.
    pub fn encoded(&mut self, luma: Arc<Luma>) {
        self.reference = Some(luma);
    }

    /// Start afresh (new caps, a flush, a seek): the next frame is a change.
    pub fn reset(&mut self) {
        self.reference = None;
    }
}

/// Blocks that must change, of `of`, for a share of `min_change`: at least one.
fn required_blocks(min_change: f64, of: usize) -> usize {
    ((min_change * of as f64).round() as usize).max(1)
}

#[cfg(test)]
mod tests {
    use super::super::PixelLayout;
    use super::*;

    /// A deterministic pseudo-random byte stream (xorshift), for noise.
    struct Noise(u64);
    impl Noise {
        fn next(&mut self) -> u8 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 >> 24) as u8
        }
    }

    const W: u32 = 320;
    const H: u32 = 240;

    /// A grey RGB picture with vertical bars, a square of full-range noise at (x0, y0) of side
    /// `noise`, plus `amp` levels of sensor noise everywhere and a white square of side `obj`
    /// at `at`.
    fn scene(seed: u64, amp: u8, noise: (u32, u32, u32), obj: Option<(u32, u32, u32)>) -> Vec<u8> {
        let mut rng = Noise(seed | 1);
        let mut data = Vec::with_capacity((W * H * 3) as usize);
        for y in 0..H {
            for x in 0..W {
                let base = 40 + (x / 40) as u8 * 20;
                let (nx, ny, ns) = noise;
                let mut v = if x >= nx && x < nx + ns && y >= ny && y < ny + ns { rng.next() } else { base };
                if let Some((ox, oy, os)) = obj
                    && x >= ox
                    && x < ox + os
                    && y >= oy
                    && y < oy + os
                {
                    v = 250;
                }
                if amp > 0 {
                    let n = rng.next() % (2 * amp + 1);
                    v = (v as i16 + n as i16 - amp as i16).clamp(0, 255) as u8;
                }
                data.extend_from_slice(&[v, v, v]);
            }
        }
        data
    }

    fn decide(gate: &ChangeGate, rgb: &[u8]) -> Decision {
        gate.decide(&Picture::packed(rgb, W, H, W as usize * 3, PixelLayout::Rgb), 0.001).unwrap()
    }

    fn encode(gate: &mut ChangeGate, rgb: &[u8]) {
        match decide(gate, rgb) {
            Decision::Changed(_, luma) => gate.encoded(Arc::new(luma)),
            other => panic!("expected a change, got {other:?}"),
        }
    }

    #[test]
    fn noise_is_not_a_change_but_a_small_moving_object_is() {
        let mut gate = ChangeGate::default();
        let noise_patch = (200, 150, 60); // ~5% of the picture, full-range noise every frame
        encode(&mut gate, &scene(1, 3, noise_patch, Some((20, 20, 12))));
        // 200 frames of the same scene, new noise each time, against one reference: at most 1%
        // taken for a change.
        let changes = (2..202)
            .filter(|&seed| {
                matches!(decide(&gate, &scene(seed, 3, noise_patch, Some((20, 20, 12)))), Decision::Changed(..))
            })
            .count();
        assert!(changes <= 2, "{changes} of 200 noisy frames taken for a change");
        // The 12 px object (0.2% of the picture) moves by its size: the block it left and the
        // one it entered changed.
        match decide(&gate, &scene(300, 3, noise_patch, Some((32, 20, 12)))) {
            Decision::Changed(Some(c), _) => assert_eq!(c.blocks, 2, "{c:?}"),
            other => panic!("a moved object must be a change: {other:?}"),
        }
    }

    #[test]
    fn a_drift_adds_up_against_the_last_encoded_frame() {
        let mut gate = ChangeGate::default();
        let base = scene(1, 0, (0, 0, 0), None);
        encode(&mut gate, &base);
        let brighter = |by: u8| base.iter().map(|v| v.saturating_add(by)).collect::<Vec<u8>>();
        // Each step is 5 levels; the gate compares with the reference, not the previous frame.
        let steps: Vec<bool> =
            (1..=6).map(|i| matches!(decide(&gate, &brighter(5 * i)), Decision::Changed(..))).collect();
        assert_eq!(steps, [false, false, false, false, true, true]);
    }

    #[test]
    fn min_change_counts_blocks_and_a_new_size_is_a_change() {
        let mut gate = ChangeGate::default();
        let a = scene(1, 0, (0, 0, 0), None);
        encode(&mut gate, &a);
        // A 64x64 white square: 16 of the 300 blocks (16 px) change.
        let b = scene(1, 0, (0, 0, 0), Some((64, 64, 64)));
        let pic = Picture::packed(&b, W, H, W as usize * 3, PixelLayout::Rgb);
        let Some(Decision::Changed(Some(c), _)) = gate.decide(&pic, 0.05) else { panic!("16 of 300 is over 5%") };
        assert_eq!((c.blocks, c.of), (16, 300));
        // The square covers pixels 64..128 each way: blocks 4..8.
        assert!(c.changed_in((64, 64, 128, 128), 0) && c.changed_in((0, 0, 65, 65), 0));
        assert!(!c.changed_in((0, 0, 64, 64), 0) && !c.changed_in((128, 0, 320, 240), 0));
        assert!(c.changed_in((128, 0, 320, 240), 1), "within the margin");
        assert!(matches!(gate.decide(&pic, 0.06), Some(Decision::Unchanged(Change { blocks: 16, of: 300, .. }, _))));
        let small = Picture::packed(&a[..(W * 3 * 120) as usize], W, 120, W as usize * 3, PixelLayout::Rgb);
        assert!(matches!(gate.decide(&small, 0.001), Some(Decision::Changed(None, _))));
        gate.reset();
        assert!(matches!(gate.decide(&pic, 0.001), Some(Decision::Changed(None, _))));
    }

    #[test]
    fn yuv_uses_the_luma_plane() {
        let y = vec![100u8; 64 * 32];
        let uv = vec![128u8; 64 * 16];
        let pic = |y: &[u8]| {
            let p = Picture {
                planes: [y, &uv, &[]],
                strides: [64, 64, 0],
                width: 64,
                height: 32,
                format: PixelFormat::Nv12(super::super::YuvMatrix::Bt601Limited),
            };
            Luma::of(&p).unwrap()
        };
        let mut moved = y.clone();
        for row in moved.chunks_mut(64).take(16) {
            row[..16].fill(250);
        }
        let c = compare(&pic(&y), &pic(&moved)).unwrap();
        assert!(c.changed_in((0, 0, 16, 16), 0) && !c.changed_in((16, 0, 64, 32), 0));
        assert_eq!((c.blocks, c.of), (1, 8));
        assert!(
            Luma::of(&Picture { planes: [&y[..10], &uv, &[]], ..Picture::packed(&y, 64, 32, 64, PixelLayout::Rgb) })
                .is_none()
        );
    }
}
