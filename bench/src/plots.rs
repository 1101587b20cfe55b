//! PNG plots drawn by the benchmark itself (plotters): TTFT distribution per configuration,
//! throughput bars and decode rates. Text uses a TrueType font found on the system (DejaVu or
//! Liberation Sans; `VLM_BENCH_FONT` names another), so no fontconfig is needed.

use std::error::Error;
use std::path::{Path, PathBuf};

use plotters::coord::Shift;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::record::{Config, RunRecord};
use crate::report::Summary;

type BoxError = Box<dyn Error + Send + Sync>;

const FONT_CANDIDATES: [&str; 5] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation/LiberationSans-Regular.ttf",
];

fn register_font() -> Result<(), BoxError> {
    let path = std::env::var_os("VLM_BENCH_FONT")
        .map(PathBuf::from)
        .or_else(|| FONT_CANDIDATES.iter().map(PathBuf::from).find(|p| p.is_file()))
        .ok_or("no TrueType font found for the plots (install fonts-dejavu-core or set VLM_BENCH_FONT)")?;
    let bytes: &'static [u8] = Box::leak(std::fs::read(&path)?.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
        .map_err(|_| format!("{} is not a usable TrueType font", path.display()))?;
    Ok(())
}

const PALETTE: [RGBColor; 7] = [
    RGBColor(0x4c, 0x72, 0xb0),
    RGBColor(0xdd, 0x84, 0x52),
    RGBColor(0x55, 0xa8, 0x68),
    RGBColor(0xc4, 0x4e, 0x52),
    RGBColor(0x81, 0x72, 0xb3),
    RGBColor(0x93, 0x78, 0x60),
    RGBColor(0xda, 0x8b, 0xc3),
];

fn color(config: Config) -> RGBColor {
    let i = crate::record::ALL_CONFIGS.iter().position(|c| *c == config).unwrap_or(0);
    PALETTE[i % PALETTE.len()]
}

type Chart<'a> = ChartContext<'a, BitMapBackend<'a>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// Configuration names under the x axis: configuration i is centred on i + 0.5.
fn name_axis(
    root: &DrawingArea<BitMapBackend<'_>, Shift>,
    chart: &Chart<'_>,
    summaries: &[Summary],
) -> Result<(), BoxError> {
    for (i, s) in summaries.iter().enumerate() {
        let (x, y) = chart.backend_coord(&(i as f64 + 0.5, 0.0));
        let style = ("sans-serif", 16).into_text_style(root).pos(Pos::new(HPos::Center, VPos::Top));
        root.draw(&Text::new(s.config.name().to_owned(), (x, y + 8), style))?;
    }
    Ok(())
}

/// Write ttft.png, throughput.png and decode.png into `dir`; the paths written.
pub fn write(dir: &Path, summaries: &[Summary], runs: &[RunRecord], title: &str) -> Result<Vec<PathBuf>, BoxError> {
    register_font()?;
    std::fs::create_dir_all(dir)?;
    let files = vec![dir.join("ttft.png"), dir.join("throughput.png"), dir.join("decode.png")];
    ttft(&files[0], summaries, runs, title)?;
    throughput(&files[1], summaries, runs, title)?;
    decode(&files[2], summaries, title)?;
    Ok(files)
}

/// Whether the answers carry the capture clock (reports made before it only have the question's).
fn has_capture_clock(runs: &[RunRecord]) -> bool {
    runs.iter().flat_map(|r| &r.answers).any(|a| a.ttft_from_capture_ms.is_some())
}

fn ttft(path: &Path, summaries: &[Summary], runs: &[RunRecord], title: &str) -> Result<(), BoxError> {
    let root = BitMapBackend::new(path, (1000, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let capture = has_capture_clock(runs);
    let points: Vec<(usize, f64)> = summaries
        .iter()
        .enumerate()
        .flat_map(|(i, s)| {
            runs.iter()
                .filter(move |r| r.config == s.config)
                .flat_map(|r| r.answers.iter())
                .filter(|a| a.error.is_none())
                .filter_map(move |a| {
                    if capture { a.ttft_from_capture_ms } else { Some(a.ttft_from_question_ms) }.map(|v| (i, v))
                })
        })
        .collect();
    let top = points.iter().map(|p| p.1).fold(1.0, f64::max) * 1.1;
    let n = summaries.len();
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "Time to first token from {}: {title}",
                if capture { "the frame's capture" } else { "the question's arrival" }
            ),
            ("sans-serif", 20),
        )
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..n as f64, 0.0..top)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_desc("TTFT (ms)")
        .x_desc("configuration (dots: answers; black: p50, red: mean, grey: p95)")
        .draw()?;
    chart.draw_series(points.iter().enumerate().map(|(k, &(i, y))| {
        let jitter = ((k * 37) % 21) as f64 / 21.0 * 0.5 - 0.25;
        Circle::new((i as f64 + 0.5 + jitter, y), 3, color(summaries[i].config).mix(0.7).filled())
    }))?;
    for (i, s) in summaries.iter().enumerate() {
        let x = i as f64;
        let (p50, mean, p95) = if capture {
            (s.ttft_from_capture_p50_ms, s.ttft_from_capture_mean_ms, s.ttft_from_capture_p95_ms)
        } else {
            (s.ttft_from_question_p50_ms, s.ttft_from_question_mean_ms, s.ttft_from_question_p95_ms)
        };
        for (v, c, w) in [(p50, BLACK, 3), (mean, RED, 2), (p95, RGBColor(150, 150, 150), 2)] {
            if v.is_finite() {
                chart.draw_series(LineSeries::new([(x + 0.15, v), (x + 0.85, v)], c.stroke_width(w)))?;
            }
        }
    }
    name_axis(&root, &chart, summaries)?;
    root.present()?;
    Ok(())
}

fn throughput(path: &Path, summaries: &[Summary], runs: &[RunRecord], title: &str) -> Result<(), BoxError> {
    let root = BitMapBackend::new(path, (1000, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let top = summaries
        .iter()
        .flat_map(|s| s.throughput_rounds.iter().copied().chain([s.throughput]))
        .filter(|v| v.is_finite())
        .fold(0.1, f64::max)
        * 1.15;
    let n = summaries.len();
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("Request throughput: {title}"), ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..n as f64, 0.0..top)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_desc("answers / s (bar: mean over rounds; dots: rounds)")
        .draw()?;
    for (i, s) in summaries.iter().enumerate() {
        let x = i as f64;
        if s.throughput.is_finite() {
            chart.draw_series([Rectangle::new([(x + 0.2, 0.0), (x + 0.8, s.throughput)], color(s.config).filled())])?;
        }
        let rounds: Vec<f64> = runs
            .iter()
            .filter(|r| r.config == s.config && r.window_ms > 0.0)
            .map(|r| r.answers.iter().filter(|a| a.error.is_none()).count() as f64 / (r.window_ms / 1e3))
            .collect();
        chart.draw_series(rounds.iter().map(|&v| Circle::new((x + 0.5, v), 4, BLACK.filled())))?;
    }
    name_axis(&root, &chart, summaries)?;
    root.present()?;
    Ok(())
}

fn decode(path: &Path, summaries: &[Summary], title: &str) -> Result<(), BoxError> {
    let root = BitMapBackend::new(path, (1000, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let series = |s: &Summary| [Some(s.decode_tok_s), s.decode_ingesting_tok_s, s.decode_idle_tok_s];
    let top = summaries.iter().flat_map(series).flatten().filter(|v| v.is_finite()).fold(1.0, f64::max) * 1.15;
    let n = summaries.len();
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("Decode rate per answer: {title}"), ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..n as f64, 0.0..top)?;
    chart.configure_mesh().disable_x_mesh().x_labels(0).y_desc("tokens / s per answer").draw()?;
    let kinds = [
        ("all answers (after the first token)", RGBColor(0x4c, 0x72, 0xb0)),
        ("engine steps while frames waited for ingestion", RGBColor(0xc4, 0x4e, 0x52)),
        ("engine steps with no ingestion waiting", RGBColor(0x55, 0xa8, 0x68)),
    ];
    for (k, (name, c)) in kinds.into_iter().enumerate() {
        let bars: Vec<_> = summaries
            .iter()
            .enumerate()
            .filter_map(|(i, s)| series(s)[k].filter(|v| v.is_finite()).map(|v| (i as f64, v)))
            .map(|(x, v)| {
                let left = x + 0.1 + 0.27 * k as f64;
                Rectangle::new([(left, 0.0), (left + 0.25, v)], c.filled())
            })
            .collect();
        chart
            .draw_series(bars)?
            .label(name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], c.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    name_axis(&root, &chart, summaries)?;
    root.present()?;
    Ok(())
}

/// One line of a line chart: its label, colour, width and points.
struct Line {
    label: String,
    color: RGBColor,
    width: u32,
    points: Vec<(f64, f64)>,
}

/// A line chart over a base-2 logarithmic x axis (stream counts, history lengths), with an
/// optional labelled horizontal reference line.
fn lines(
    path: &Path,
    caption: &str,
    (x_desc, y_desc): (&str, &str),
    series: &[Line],
    reference: Option<(f64, &str)>,
) -> Result<(), BoxError> {
    let root = BitMapBackend::new(path, (1000, 600)).into_drawing_area();
    root.fill(&WHITE)?;
    let xs: Vec<f64> = series.iter().flat_map(|l| l.points.iter().map(|p| p.0)).collect();
    let (lo, hi) = xs.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &x| (lo.min(x), hi.max(x)));
    let (lo, hi) = if lo.is_finite() { (lo.log2(), hi.log2().max(lo.log2() + 1.0)) } else { (0.0, 1.0) };
    let top = series
        .iter()
        .flat_map(|l| l.points.iter().map(|p| p.1))
        .chain(reference.map(|r| r.0))
        .filter(|v| v.is_finite())
        .fold(1e-3, f64::max)
        * 1.4; // room for the legend in the upper left
    let mut chart = ChartBuilder::on(&root)
        .caption(caption, ("sans-serif", 17))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d((lo - 0.25)..(hi + 0.25), 0.0..top)?;
    chart
        .configure_mesh()
        .x_labels((hi - lo) as usize * 4 + 1)
        .x_label_formatter(&|v| {
            let x = v.exp2();
            if (x - x.round()).abs() < 1e-6 && (v - v.round()).abs() < 1e-6 { format!("{x:.0}") } else { String::new() }
        })
        .y_label_formatter(&|v| if top < 10.0 { format!("{v:.2}") } else { format!("{v:.0}") })
        .light_line_style(RGBColor(245, 245, 245))
        .x_desc(x_desc)
        .y_desc(y_desc)
        .draw()?;
    if let Some((y, label)) = reference {
        chart
            .draw_series(LineSeries::new([(lo - 0.25, y), (hi + 0.25, y)], BLACK.stroke_width(2)))?
            .label(label)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], BLACK.stroke_width(2)));
    }
    for l in series {
        let points: Vec<(f64, f64)> =
            l.points.iter().filter(|p| p.1.is_finite()).map(|&(x, y)| (x.log2(), y)).collect();
        let (c, w) = (l.color, l.width);
        chart
            .draw_series(LineSeries::new(points.iter().copied(), c.stroke_width(w)))?
            .label(l.label.as_str())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], c.stroke_width(w)));
        chart.draw_series(points.iter().map(|&p| Circle::new(p, w + 2, c.filled())))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

/// The capacity report's plots: TTFT, answers/s and peak RSS against the stream count, and TTFT
/// against history length; the paths written.
pub fn capacity(
    dir: &Path,
    levels: &[crate::levels::Level],
    history: &[crate::levels::HistoryPoint],
    target_ms: f64,
    [title, history_title]: &[String; 2],
) -> Result<Vec<PathBuf>, BoxError> {
    register_font()?;
    std::fs::create_dir_all(dir)?;
    let mut configs: Vec<Config> = vec![];
    for c in levels.iter().map(|l| l.config).chain(history.iter().map(|p| p.config)) {
        if !configs.contains(&c) {
            configs.push(c);
        }
    }
    let per_level = |value: &dyn Fn(&crate::levels::Level) -> f64, suffix: &str, width: u32| -> Vec<Line> {
        configs
            .iter()
            .map(|&c| Line {
                label: format!("{c}{suffix}"),
                color: color(c),
                width,
                points: levels.iter().filter(|l| l.config == c).map(|l| (l.streams as f64, value(l))).collect(),
            })
            .filter(|l| !l.points.is_empty())
            .collect()
    };
    let mut files = vec![];
    if !levels.is_empty() {
        let path = dir.join("capacity-ttft.png");
        // Reports made before the capture clock have only the question's.
        let capture = levels.iter().any(|l| l.summary.ttft_from_capture_mean_ms.is_finite());
        let mut series = if capture {
            let mut s = per_level(&|l| l.summary.ttft_from_capture_p95_ms, " p95", 3);
            s.extend(per_level(&|l| l.summary.ttft_from_capture_mean_ms, " mean", 1));
            s
        } else {
            let mut s = per_level(&|l| l.summary.ttft_from_question_p95_ms, " p95", 3);
            s.extend(per_level(&|l| l.summary.ttft_from_question_mean_ms, " mean", 1));
            s
        };
        series.retain(|l| l.points.iter().any(|p| p.1.is_finite()));
        let target = format!("target p95 {target_ms:.0} ms");
        let caption =
            format!("TTFT from {}: {title}", if capture { "the frame's capture" } else { "the question's arrival" });
        lines(&path, &caption, ("live streams", "TTFT (ms)"), &series, Some((target_ms, &target)))?;
        files.push(path);

        let path = dir.join("capacity-throughput.png");
        let mut series = per_level(&|l| l.summary.throughput, " answers/s", 3);
        let asked: Vec<(f64, f64)> = {
            let mut v: Vec<(f64, f64)> = levels.iter().map(|l| (l.streams as f64, l.offered_per_s)).collect();
            v.dedup_by(|a, b| a.0 == b.0);
            v
        };
        series.push(Line {
            label: "questions asked/s".into(),
            color: RGBColor(120, 120, 120),
            width: 1,
            points: asked,
        });
        let caption = format!("Answers per second: {title}");
        lines(&path, &caption, ("live streams", "answers / s"), &series, None)?;
        files.push(path);

        let path = dir.join("capacity-rss.png");
        let series = per_level(&|l| l.summary.peak_rss_mib, "", 3);
        let caption = format!("Peak RSS: {title}");
        lines(&path, &caption, ("live streams", "peak RSS (MiB)"), &series, None)?;
        files.push(path);
    }
    if !history.is_empty() {
        let path = dir.join("history-ttft.png");
        let series: Vec<Line> = configs
            .iter()
            .map(|&c| Line {
                label: format!("{c} (median)"),
                color: color(c),
                width: 3,
                points: history
                    .iter()
                    .filter(|p| p.config == c)
                    .map(|p| (p.frames as f64, p.ttft_from_question_median_ms))
                    .collect(),
            })
            .filter(|l| !l.points.is_empty())
            .collect();
        let caption = format!("TTFT from the question against history, one stream: {history_title}");
        lines(&path, &caption, ("frames of history", "TTFT (ms)"), &series, None)?;
        files.push(path);
    }
    Ok(files)
}
