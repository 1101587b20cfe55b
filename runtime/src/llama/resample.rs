//! The picture resize of libmtmd's tiled (idefics3/SmolVLM) preprocessor, done before libmtmd
//! sees the picture and spread over several threads.
//!
//! libmtmd prepares a SmolVLM frame on the calling thread: it resizes the picture so that its
//! longest edge is the projector's `clip.vision.preproc_image_size` (2048 px for SmolVLM), then
//! stretches it to whole tiles, and only then cuts the tiles, resizes the overview from them and
//! normalises all of them, on one core, on the capture clock of every frame. The two first
//! resizes are a third of a 1080p frame's preparation and a tenth of a 320x240 one's (measured:
//! docs/benchmarks.md, "The picture resized before libmtmd"); the rest stays libmtmd's, since
//! nothing in its interface takes a prepared tile. Here the same two resizes run first, bit for bit as libmtmd's
//! `resize_pillow` computes them (Pillow's fixed-point convolution with its Lanczos filter:
//! the same weights from the same double arithmetic, the same 22-bit rounding), the rows of
//! each pass split over threads. libmtmd is then handed the picture at its tiled size, where
//! its own resizes are copies, so the tiles and the overview it cuts are the ones it would have
//! cut from the original picture (tested against libmtmd's own path in `mtmd`'s tests).

use std::f64::consts::PI;

/// Fixed-point precision of the weights: 32 bits less 8 for the pixel and 2 of headroom.
const PRECISION_BITS: u32 = 22;

/// Pillow's Lanczos filter (support 3), as libmtmd writes it.
fn lanczos(x: f64) -> f64 {
    fn sinc(v: f64) -> f64 {
        if v == 0.0 {
            return 1.0;
        }
        let pi_v = v * PI;
        pi_v.sin() / pi_v
    }
    if (-3.0..3.0).contains(&x) { sinc(x) * sinc(x / 3.0) } else { 0.0 }
}

/// One dimension's filter: for each output pixel, the first input pixel and how many contribute,
/// and `ksize` fixed-point weights (zero-padded).
struct Kernel {
    ksize: usize,
    bounds: Vec<(usize, usize)>,
    weights: Vec<i32>,
}

impl Kernel {
    /// libmtmd's `precompute_weights`, operation for operation.
    fn new(in_size: usize, out_size: usize) -> Kernel {
        let scale = in_size as f64 / out_size as f64;
        let filterscale = scale.max(1.0);
        let support = 3.0 * filterscale;
        let ksize = support.ceil() as usize * 2 + 1;
        let mut bounds = Vec::with_capacity(out_size);
        let mut weights = vec![0i32; out_size * ksize];
        let mut pre = vec![0f64; ksize];
        let fxp_scale = f64::from(1u32 << PRECISION_BITS);
        for xx in 0..out_size {
            let center = (xx as f64 + 0.5) * scale;
            let ss = 1.0 / filterscale;
            let xmin = ((center - support + 0.5) as i64).max(0);
            let xmax = ((center + support + 0.5) as i64).min(in_size as i64) - xmin;
            let (xmin, count) = (xmin as usize, xmax.max(0) as usize);
            let mut ww = 0.0;
            pre.fill(0.0);
            for (x, p) in pre.iter_mut().enumerate().take(count) {
                let w = lanczos(((x + xmin) as f64 - center + 0.5) * ss);
                *p = w;
                ww += w;
            }
            for p in pre.iter_mut().take(count) {
                if ww != 0.0 {
                    *p /= ww;
                }
            }
            for (k, p) in weights[xx * ksize..(xx + 1) * ksize].iter_mut().zip(&pre) {
                *k = (p * fxp_scale + if *p < 0.0 { -0.5 } else { 0.5 }) as i32;
            }
            bounds.push((xmin, count));
        }
        Kernel { ksize, bounds, weights }
    }

    fn taps(&self, out: usize) -> (usize, &[i32]) {
        let (first, count) = self.bounds[out];
        (first, &self.weights[out * self.ksize..out * self.ksize + count])
    }
}

fn clip8(v: i32) -> u8 {
    (v >> PRECISION_BITS).clamp(0, 255) as u8
}

const ROUNDING: i32 = 1 << (PRECISION_BITS - 1);

/// Each pass is compiled twice on x86-64: for the baseline target (SSE2, which has no 32-bit
/// vector multiply) and with AVX2, taken where the CPU has it, so the multiply-adds vectorize
/// eight lanes wide (measured on this project's 2-core machine beside a build: the 320x240 to
/// 2048x1536 resize took 40 ms on the baseline and 26 ms with AVX2, on one thread). The arithmetic is the same integer
/// arithmetic either way.
macro_rules! multiversion {
    ($($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*) $body:block)*) => {$(
        $(#[$doc])*
        fn $name($($arg: $ty),*) {
            #[inline(always)]
            fn body($($arg: $ty),*) $body
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2")]
            fn avx2($($arg: $ty),*) {
                body($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2 (checked just above).
                return unsafe { avx2($($arg),*) };
            }
            body($($arg),*)
        }
    )*};
}

multiversion! {
/// Rows `rows` of the horizontal pass into `out` (those rows, `out_w` pixels each).
fn horizontal(src: &[u8], in_w: usize, out_w: usize, kernel: &Kernel, rows: std::ops::Range<usize>, out: &mut [u8]) {
    for (y, dst) in rows.zip(out.chunks_exact_mut(out_w * 3)) {
        let row = &src[y * in_w * 3..(y + 1) * in_w * 3];
        for (xx, px) in dst.chunks_exact_mut(3).enumerate() {
            let (first, k) = kernel.taps(xx);
            let (mut s0, mut s1, mut s2) = (ROUNDING, ROUNDING, ROUNDING);
            for (p, &w) in row[first * 3..].chunks_exact(3).zip(k) {
                s0 += i32::from(p[0]) * w;
                s1 += i32::from(p[1]) * w;
                s2 += i32::from(p[2]) * w;
            }
            px.copy_from_slice(&[clip8(s0), clip8(s1), clip8(s2)]);
        }
    }
}

/// Output rows `rows` of the vertical pass into `out`, whole rows of `width` pixels at a time.
fn vertical(src: &[u8], width: usize, kernel: &Kernel, rows: std::ops::Range<usize>, out: &mut [u8]) {
    let row_len = width * 3;
    let mut acc = vec![0i32; row_len];
    for (yy, dst) in rows.zip(out.chunks_exact_mut(row_len)) {
        let (first, k) = kernel.taps(yy);
        acc.fill(ROUNDING);
        for (y, &w) in (first..).zip(k) {
            for (a, &p) in acc.iter_mut().zip(&src[y * row_len..(y + 1) * row_len]) {
                *a += i32::from(p) * w;
            }
        }
        for (d, &a) in dst.iter_mut().zip(&acc) {
            *d = clip8(a);
        }
    }
}
}

/// Run `pass(rows, out)` over `rows` output rows of `row_len` bytes, split over `threads`.
fn split_rows(
    rows: usize,
    row_len: usize,
    threads: usize,
    pass: impl Fn(std::ops::Range<usize>, &mut [u8]) + Sync,
) -> Vec<u8> {
    let mut out = vec![0u8; rows * row_len];
    let per = rows.div_ceil(threads.clamp(1, rows.max(1)));
    if per >= rows {
        pass(0..rows, &mut out);
        return out;
    }
    std::thread::scope(|scope| {
        for (i, part) in out.chunks_mut(per * row_len).enumerate() {
            let pass = &pass;
            let start = i * per;
            let range = start..start + part.len() / row_len;
            scope.spawn(move || pass(range, part));
        }
    });
    out
}

/// Resize packed RGB `src` (`w` × `h`) to `out_w` × `out_h` as libmtmd's `resize_pillow` does
/// with the Lanczos filter (a pass is skipped where its dimension does not change), on up to
/// `threads` threads.
pub fn resize_lanczos(src: &[u8], w: usize, h: usize, out_w: usize, out_h: usize, threads: usize) -> Vec<u8> {
    debug_assert_eq!(src.len(), w * h * 3);
    let wide = (out_w != w).then(|| {
        let kernel = Kernel::new(w, out_w);
        split_rows(h, out_w * 3, threads, |rows, out| horizontal(src, w, out_w, &kernel, rows, out))
    });
    if out_h == h {
        return wide.unwrap_or_else(|| src.to_vec());
    }
    let (src, w) = wide.as_deref().map_or((src, w), |wide| (wide, out_w));
    let kernel = Kernel::new(h, out_h);
    split_rows(out_h, w * 3, threads, |rows, out| vertical(src, w, &kernel, rows, out))
}

/// The tiled preprocessor's sizes for a `width` × `height` picture (libmtmd's
/// `mtmd_image_preprocessor_idefics3` with a longest edge): the picture with its longest edge at
/// `longest_edge` (the other rounded down, then up to even), and that stretched to whole tiles of
/// `tile` px.
pub fn tiled_sizes(width: u32, height: u32, tile: u32, longest_edge: u32) -> ((u32, u32), (u32, u32)) {
    let aspect = f64::from(width) / f64::from(height);
    let resized = if width >= height {
        let h = (f64::from(longest_edge) / aspect) as u32;
        (longest_edge, h + h % 2)
    } else {
        let w = (f64::from(longest_edge) * aspect) as u32;
        (w + w % 2, longest_edge)
    };
    let refined = (resized.0.div_ceil(tile) * tile, resized.1.div_ceil(tile) * tile);
    (resized, refined)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn picture(w: usize, h: usize) -> Vec<u8> {
        (0..w * h * 3).map(|i| ((i * 7919) ^ (i / 3 * 31)) as u8).collect()
    }

    #[test]
    fn threads_do_not_change_the_picture() {
        let src = picture(37, 23);
        for (ow, oh) in [(128, 96), (16, 40), (37, 64), (90, 23)] {
            let one = resize_lanczos(&src, 37, 23, ow, oh, 1);
            assert_eq!(one.len(), ow * oh * 3);
            for threads in [2, 3, 8, 100] {
                assert_eq!(resize_lanczos(&src, 37, 23, ow, oh, threads), one, "{ow}x{oh} on {threads}");
            }
        }
    }

    #[test]
    fn a_flat_picture_stays_flat_and_weights_sum_to_one() {
        let src = vec![200u8; 20 * 10 * 3];
        assert!(resize_lanczos(&src, 20, 10, 64, 7, 2).iter().all(|&p| p == 200));
        for (i, o) in [(20, 64), (64, 20), (480, 1536), (1536, 512)] {
            let k = Kernel::new(i, o);
            for xx in 0..o {
                let sum: i64 = k.taps(xx).1.iter().map(|&w| i64::from(w)).sum();
                assert!((sum - (1 << PRECISION_BITS)).abs() <= k.ksize as i64, "{i}->{o} at {xx}: {sum}");
            }
        }
    }

    #[test]
    fn sizes_follow_the_longest_edge_then_whole_tiles() {
        assert_eq!(tiled_sizes(640, 480, 512, 2048), ((2048, 1536), (2048, 1536)));
        assert_eq!(tiled_sizes(640, 360, 512, 2048), ((2048, 1152), (2048, 1536)));
        assert_eq!(tiled_sizes(480, 640, 512, 2048), ((1536, 2048), (1536, 2048)));
        assert_eq!(tiled_sizes(160, 120, 64, 128), ((128, 96), (128, 128)));
        // The tiled size is its own: handed that, libmtmd's resizes are copies.
        for (w, h) in [(640, 480), (640, 360), (333, 1001), (1920, 1080), (97, 13)] {
            let (_, refined) = tiled_sizes(w, h, 512, 2048);
            assert_eq!(tiled_sizes(refined.0, refined.1, 512, 2048), (refined, refined), "{w}x{h}");
        }
    }
}
