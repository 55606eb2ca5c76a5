//! `loss.svg`: train loss (and validation loss, when there is any) against the optimizer step.
//!
//! plotters' SVG backend writes text as `<text>` elements and sizes labels with its built-in
//! estimate, so no font files or system libraries are needed (the crate is built without `ttf`).
//! The y axis is logarithmic when the loss spans more than a factor of 10, as a fine-tuning curve
//! usually does (6.2 → 0.03 on the smoke run): on a linear axis the whole second half is flat.

use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::{Path, PathBuf};

use rtune_fsio::{write_atomic, Privacy};

use crate::{Result, WatchError};

/// File name of the plot in a run directory.
pub const LOSS_PLOT: &str = "loss.svg";

const TRAIN: RGBColor = RGBColor(31, 119, 180);
const VALID: RGBColor = RGBColor(214, 39, 40);

fn finite(points: &[(u64, f64)]) -> Vec<(f64, f64)> {
    points
        .iter()
        .filter(|(_, y)| y.is_finite())
        .map(|&(x, y)| (x as f64, y))
        .collect()
}

/// Draws train (blue line) and validation (red line with dots) loss against step into an SVG file
/// at `path`, written atomically. Non-finite points (skipped steps) are left out.
pub fn write_loss_plot(
    path: &Path,
    train: &[(u64, f64)],
    valid: &[(u64, f64)],
    privacy: Privacy,
) -> Result<()> {
    let svg = render(train, valid).map_err(|message| WatchError::Plot {
        path: path.to_path_buf(),
        message,
    })?;
    write_atomic(path, svg.as_bytes(), privacy)?;
    Ok(())
}

fn render(train: &[(u64, f64)], valid: &[(u64, f64)]) -> std::result::Result<String, String> {
    let (t, v) = (finite(train), finite(valid));
    let all: Vec<&(f64, f64)> = t.iter().chain(&v).collect();
    if all.is_empty() {
        return Err("no finite loss values to plot".into());
    }
    let (mut x0, mut x1) = all
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
    if x1 <= x0 {
        (x0, x1) = (x0 - 1.0, x1 + 1.0);
    }
    let (lo, hi) = all
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.1), b.max(p.1)));
    let log = lo > 0.0 && hi / lo > 10.0;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (800, 480)).into_drawing_area();
        let e = |e: DrawingAreaErrorKind<std::io::Error>| e.to_string();
        root.fill(&WHITE).map_err(e)?;
        let caption = if log { "loss (log scale)" } else { "loss" };
        if log {
            let y = y_lo(lo)..(hi * 1.25);
            let y = y
                .log_scale()
                .with_key_points(log_ticks(y_lo(lo), hi * 1.25));
            draw(&root, caption, x0..x1, y, &t, &v)?;
        } else {
            let pad = ((hi - lo) * 0.05).max(1e-6);
            draw(&root, caption, x0..x1, (lo - pad)..(hi + pad), &t, &v)?;
        }
        root.present().map_err(e)?;
    }
    Ok(svg)
}

fn draw<Y>(
    root: &DrawingArea<SVGBackend, Shift>,
    caption: &str,
    x: std::ops::Range<f64>,
    y: Y,
    train: &[(f64, f64)],
    valid: &[(f64, f64)],
) -> std::result::Result<(), String>
where
    Y: plotters::coord::ranged1d::AsRangedCoord<Value = f64>,
    <Y as plotters::coord::ranged1d::AsRangedCoord>::CoordDescType:
        plotters::coord::ranged1d::ValueFormatter<f64>,
{
    let e = |e: DrawingAreaErrorKind<std::io::Error>| e.to_string();
    let mut chart = ChartBuilder::on(root)
        .caption(caption, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(x, y)
        .map_err(e)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("loss")
        .x_label_formatter(&|x| format!("{}", x.round() as i64))
        .y_label_formatter(&|y| short(*y))
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .map_err(e)?;
    if !train.is_empty() {
        chart
            .draw_series(LineSeries::new(
                train.iter().copied(),
                TRAIN.stroke_width(2),
            ))
            .map_err(e)?
            .label("train")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], TRAIN.stroke_width(2)));
    }
    if !valid.is_empty() {
        chart
            .draw_series(LineSeries::new(
                valid.iter().copied(),
                VALID.stroke_width(2),
            ))
            .map_err(e)?
            .label("validation")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], VALID.stroke_width(2)));
        chart
            .draw_series(valid.iter().map(|&p| Circle::new(p, 3, VALID.filled())))
            .map_err(e)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .border_style(BLACK)
        .background_style(WHITE.mix(0.9))
        .draw()
        .map_err(e)
}

fn y_lo(lo: f64) -> f64 {
    lo / 1.25
}

/// Ticks for a log axis over `lo..hi`: 1, 2 and 5 times each power of ten in range (plotters' own
/// skip the partial decades at the ends).
fn log_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let mut ticks = Vec::new();
    for e in lo.log10().floor() as i32..=hi.log10().ceil() as i32 {
        for m in [1.0, 2.0, 5.0] {
            let t = m * 10f64.powi(e);
            if (lo..=hi).contains(&t) {
                ticks.push(t);
            }
        }
    }
    ticks
}

/// Three significant digits, no trailing zeros: `6`, `0.7`, `0.125`, `1.5e-5`.
fn short(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return format!("{v}");
    }
    let mag = v.abs().log10().floor() as i32;
    if !(-4..6).contains(&mag) {
        return format!("{v:.2e}");
    }
    let s = format!("{v:.*}", (2 - mag).max(0) as usize);
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// `(step, loss)` pairs.
pub type Points = Vec<(u64, f64)>;

/// Keys of a metrics line that hold a validation loss (the trainer writes `{step, valid_loss,
/// valid_ppl, valid_tokens}` lines every `eval_every` steps; the other names are other tools').
/// The same line's `loss`, if any, is the train loss of that step.
const VALID_KEYS: [&str; 4] = ["valid_loss", "val_loss", "eval_loss", "validation_loss"];

/// Train and validation loss points from a run's `metrics.jsonl`: train `loss` from each step line
/// (a `skipped` step with a non-finite loss is left out), validation loss from any line with one of
/// `VALID_KEYS`. A last line without its newline (a run killed mid-write) is ignored; any other
/// line that is not JSON is an error naming the line.
pub fn read_metrics(path: &Path) -> Result<(Points, Points)> {
    let text = std::fs::read_to_string(path).map_err(|source| rtune_fsio::IoError {
        path: path.to_path_buf(),
        op: "read",
        source,
    })?;
    let complete = if text.ends_with('\n') {
        &text[..]
    } else {
        &text[..text.rfind('\n').map_or(0, |i| i + 1)]
    };
    let (mut train, mut valid) = (Vec::new(), Vec::new());
    for (i, line) in complete.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |message: String| WatchError::Metrics {
            path: path.to_path_buf(),
            line: i + 1,
            message,
        };
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| bad(format!("not JSON: {e}")))?;
        let step = v
            .get("step")
            .and_then(|s| s.as_u64())
            .ok_or_else(|| bad("no integer `step`".into()))?;
        let num = |k: &str| v.get(k).and_then(|x| x.as_f64());
        if let Some(val) = VALID_KEYS.iter().find_map(|k| num(k)) {
            valid.push((step, val));
        }
        if let Some(loss) = num("loss") {
            train.push((step, loss));
        }
    }
    Ok((train, valid))
}

/// Reads `run_dir/metrics.jsonl` and writes `run_dir/loss.svg`; returns the plot's path.
pub fn plot_run(run_dir: &Path, privacy: Privacy) -> Result<PathBuf> {
    let (train, valid) = read_metrics(&run_dir.join("metrics.jsonl"))?;
    let out = run_dir.join(LOSS_PLOT);
    write_loss_plot(&out, &train, &valid, privacy)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("rtune-plot-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// The y coordinates of the points of the first `<polyline>` with `stroke` colour `color`.
    fn polyline(svg: &str, color: &str) -> Vec<(f64, f64)> {
        let line = svg
            .lines()
            .find(|l| l.starts_with("<polyline") && l.contains(color))
            .unwrap_or_else(|| panic!("no polyline in {color}"));
        let pts = line
            .split("points=\"")
            .nth(1)
            .unwrap()
            .split('"')
            .next()
            .unwrap();
        pts.split_whitespace()
            .map(|p| {
                let (x, y) = p.split_once(',').unwrap();
                (x.parse().unwrap(), y.parse().unwrap())
            })
            .collect()
    }

    #[test]
    fn plot_has_both_series_falling_and_a_legend() {
        let dir = tmpdir("p");
        let train: Vec<(u64, f64)> = (1..=50).map(|s| (s, 6.0 / s as f64)).collect();
        let valid = vec![(10, 0.9), (20, 0.5), (30, f64::NAN), (40, 0.2)];
        let p = dir.join(LOSS_PLOT);
        write_loss_plot(&p, &train, &valid, Privacy::PRIVATE).unwrap();
        let svg = std::fs::read_to_string(&p).unwrap();
        assert!(svg.starts_with("<svg"));
        assert!(
            svg.contains("\ntrain\n") && svg.contains("\nvalidation\n"),
            "legend"
        );
        assert!(svg.contains("loss (log scale)"), "6 -> 0.12 spans 50x");
        // SVG y grows downward: a falling loss is a rising y, and x grows with the step.
        let t = polyline(&svg, "#1F77B4");
        assert_eq!(t.len(), 50);
        assert!(t.windows(2).all(|w| w[1].0 > w[0].0 && w[1].1 > w[0].1));
        let v = polyline(&svg, "#D62728");
        assert_eq!(v.len(), 3, "the NaN point is left out");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn log_ticks_cover_partial_decades() {
        assert_eq!(
            log_ticks(0.028, 7.8),
            vec![0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0]
        );
    }

    #[test]
    fn labels_are_short() {
        assert_eq!(short(0.7000000000001), "0.7");
        assert_eq!(short(6.0), "6");
        assert_eq!(short(0.125), "0.125");
        assert_eq!(short(1234.6), "1235");
        assert_eq!(short(1.5e-5), "1.50e-5");
    }

    #[test]
    fn single_point_and_empty_input() {
        let dir = tmpdir("one");
        let p = dir.join("one.svg");
        write_loss_plot(&p, &[(1, 2.0)], &[], Privacy::SHARED).unwrap();
        assert!(!std::fs::read_to_string(&p).unwrap().contains("log scale"));
        let e = write_loss_plot(
            &dir.join("none.svg"),
            &[(1, f64::NAN)],
            &[],
            Privacy::SHARED,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("none.svg") && e.contains("no finite"), "{e}");
        assert!(!dir.join("none.svg").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn metrics_jsonl_train_valid_and_torn_last_line() {
        let dir = tmpdir("m");
        let m = dir.join("metrics.jsonl");
        std::fs::write(
            &m,
            concat!(
                "{\"step\":1,\"loss\":6.5,\"lr\":0.001,\"skipped\":false}\n",
                "{\"step\":2,\"loss\":null,\"skipped\":true}\n",
                "{\"step\":2,\"valid_loss\":5.0,\"valid_ppl\":148.4,\"valid_tokens\":9}\n",
                "{\"step\":3,\"loss\":4.5,\"eval_loss\":4.9}\n",
                "{\"step\":4,\"lo"
            ),
        )
        .unwrap();
        let (t, v) = read_metrics(&m).unwrap();
        assert_eq!(t, vec![(1, 6.5), (3, 4.5)]);
        assert_eq!(v, vec![(2, 5.0), (3, 4.9)]);
        let out = plot_run(&dir, Privacy::PRIVATE).unwrap();
        assert_eq!(out, dir.join(LOSS_PLOT));
        assert!(out.exists());
        std::fs::write(&m, "{\"step\":1,\"loss\":1}\nnot json\n").unwrap();
        let e = read_metrics(&m).unwrap_err().to_string();
        assert!(e.contains("metrics.jsonl:2:"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
