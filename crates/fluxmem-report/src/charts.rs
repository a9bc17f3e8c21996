//! The report's charts: SVG strings drawn by `plotters`, embedded inline in the HTML.
//!
//! Titles live in the HTML around each chart; the SVGs hold only axes, bars, lines and labels.
//! Values that are not finite (a NaN PEMS) are left out of the charts rather than breaking
//! their ranges.

use crate::{Error, Result};
use plotters::coord::ranged1d::{SegmentValue, SegmentedCoord};
use plotters::coord::types::RangedCoordu32;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// Bar, line and label colours (colour-blind safe; meaning is never carried by colour alone).
const BAR: RGBColor = RGBColor(0x3b, 0x6e, 0xa8);
const LINE: RGBColor = RGBColor(0xc4, 0x5a, 0x1b);
const GRID: RGBColor = RGBColor(0xe3, 0xe6, 0xea);
const AXIS: RGBColor = RGBColor(0x55, 0x5b, 0x63);
const INK: RGBColor = RGBColor(0x22, 0x26, 0x2b);
const FONT: &str = "sans-serif";

/// Width and height of the full-size charts, in pixels.
pub(crate) const CHART_SIZE: (u32, u32) = (500, 260);
/// Width and height of a skill's PEMS sparkline, in pixels.
pub(crate) const SPARKLINE_SIZE: (u32, u32) = (150, 34);

type DrawResult<T> = std::result::Result<T, DrawingAreaErrorKind<std::io::Error>>;

/// Draws into an SVG string of `size`; `chart` names the chart in errors.
fn svg(
    chart: &str,
    size: (u32, u32),
    draw: impl FnOnce(&DrawingArea<SVGBackend, Shift>) -> DrawResult<()>,
) -> Result<String> {
    let failed = |message: String| Error::Chart {
        chart: chart.to_string(),
        message,
    };
    // plotters can panic on odd ranges (integer overflow in its tick computation): a chart must
    // not take the run down, so a panic becomes this chart's error.
    let drawn = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut out = String::new();
        let root = SVGBackend::with_string(&mut out, size).into_drawing_area();
        let drawn = root
            .fill(&WHITE)
            .and_then(|()| draw(&root))
            .and_then(|()| root.present());
        drop(root);
        drawn.map(|()| out).map_err(|error| error.to_string())
    }));
    match drawn {
        Ok(result) => result.map_err(failed),
        Err(panic) => {
            let message = panic
                .downcast_ref::<&str>()
                .map(|text| text.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "panicked".to_string());
            Err(failed(format!("plotters panicked: {message}")))
        }
    }
}

fn label_style(size: u32) -> TextStyle<'static> {
    // The SVG backend writes font-size = size / 1.24: 15 gives 12px text.
    (FONT, size).into_font().color(&INK)
}

/// The upper end of an axis holding values up to `max`: some head room, never an empty range.
fn axis_top(max: f64) -> f64 {
    if max.is_finite() && max > 0.0 {
        max * 1.15
    } else {
        1.0
    }
}

/// `count` equal slots 0..count for bars or rounds (plotters' integer ranges include their end, so
/// `0..count` would add an empty slot).
fn slots(count: u32) -> SegmentedCoord<RangedCoordu32> {
    (0..count.max(1) - 1).into_segmented()
}

/// Shortens a label to `max` characters, marking the cut with an ellipsis.
fn shorten(label: &str, max: usize) -> String {
    if label.chars().count() <= max {
        label.to_string()
    } else {
        let kept: String = label.chars().take(max.saturating_sub(1)).collect();
        format!("{kept}…")
    }
}

/// Formats a count or a duration for a bar's end label.
fn short_number(value: f64) -> String {
    if (value == value.trunc() && value.abs() < 1e9) || value.abs() >= 100.0 {
        format!("{value:.0}")
    } else if value.abs() >= 10.0 {
        format!("{value:.1}")
    } else {
        format!("{value:.2}")
    }
}

/// Horizontal bars, one per `(label, value)`, first at the top, each with its value and `unit`
/// at its end.
pub(crate) fn horizontal_bars(chart: &str, bars: &[(String, f64)], unit: &str) -> Result<String> {
    let count = bars.len() as u32;
    let longest = bars
        .iter()
        .map(|(label, _)| label.chars().count().min(18))
        .max()
        .unwrap_or(4);
    let height = (44 + 32 * count).max(120);
    let max = bars
        .iter()
        .map(|(_, value)| *value)
        .filter(|v| v.is_finite())
        .fold(0.0, f64::max);
    svg(chart, (CHART_SIZE.0, height), |root| {
        let mut plot = ChartBuilder::on(root)
            .margin(12)
            .margin_right(20)
            .x_label_area_size(24)
            .y_label_area_size(16 + 7 * longest as u32)
            .build_cartesian_2d(0.0..axis_top(max) * 1.1, slots(count))?;
        plot.configure_mesh()
            .disable_y_mesh()
            .light_line_style(TRANSPARENT)
            .bold_line_style(GRID)
            .axis_style(AXIS)
            .label_style(label_style(15))
            .x_labels(6)
            .x_label_formatter(&|seconds| format!("{} {unit}", short_number(*seconds)))
            .y_labels(count as usize)
            .y_label_formatter(&|segment| match segment {
                SegmentValue::CenterOf(index) if *index < count => {
                    shorten(&bars[(count - 1 - index) as usize].0, 18)
                }
                _ => String::new(),
            })
            .draw()?;
        let row = |index: usize| count - 1 - index as u32;
        plot.draw_series(
            bars.iter()
                .enumerate()
                .filter(|(_, (_, v))| v.is_finite())
                .map(|(index, (_, value))| {
                    let mut bar = Rectangle::new(
                        [
                            (0.0, SegmentValue::Exact(row(index))),
                            (*value, SegmentValue::Exact(row(index) + 1)),
                        ],
                        BAR.filled(),
                    );
                    bar.set_margin(5, 5, 0, 0);
                    bar
                }),
        )?;
        plot.draw_series(
            bars.iter()
                .enumerate()
                .filter(|(_, (_, v))| v.is_finite())
                .map(|(index, (_, value))| {
                    EmptyElement::at((*value, SegmentValue::CenterOf(row(index))))
                        + Text::new(
                            format!("{} {unit}", short_number(*value)),
                            (5, 0),
                            label_style(15).pos(Pos::new(HPos::Left, VPos::Center)),
                        )
                }),
        )?;
        Ok(())
    })
}

/// Vertical bars, one per value, labelled `first_label`, `first_label + 1`, ... on the x axis
/// (at most about 20 labels, so many bars stay readable).
pub(crate) fn vertical_bars(
    chart: &str,
    values: &[u64],
    first_label: u32,
    x_desc: &str,
    y_desc: &str,
) -> Result<String> {
    let count = values.len() as u32;
    let max = values.iter().copied().max().unwrap_or(0) as f64;
    let label_every = count.div_ceil(20).max(1);
    svg(chart, CHART_SIZE, |root| {
        let mut plot = ChartBuilder::on(root)
            .margin(12)
            .margin_right(20)
            .x_label_area_size(40)
            .y_label_area_size(66)
            .build_cartesian_2d(slots(count), 0.0..axis_top(max))?;
        plot.configure_mesh()
            .disable_x_mesh()
            .light_line_style(TRANSPARENT)
            .bold_line_style(GRID)
            .axis_style(AXIS)
            .label_style(label_style(15))
            .axis_desc_style(label_style(15))
            .x_desc(x_desc)
            .y_desc(y_desc)
            .x_labels(count as usize)
            .x_label_formatter(&|segment| match segment {
                SegmentValue::CenterOf(index) if *index < count && index % label_every == 0 => {
                    (index + first_label).to_string()
                }
                _ => String::new(),
            })
            .y_labels(6)
            .y_label_formatter(&|value| short_number(*value))
            .draw()?;
        plot.draw_series(values.iter().enumerate().map(|(index, value)| {
            let index = index as u32;
            let mut bar = Rectangle::new(
                [
                    (SegmentValue::Exact(index), 0.0),
                    (SegmentValue::Exact(index + 1), *value as f64),
                ],
                BAR.filled(),
            );
            let gap = if count > 40 { 0 } else { 3 };
            bar.set_margin(0, 0, gap, gap);
            bar
        }))?;
        Ok(())
    })
}

/// A line with a marker per point over rounds 1, 2, ...; non-finite values are left out.
pub(crate) fn round_line(chart: &str, values: &[f64], y_desc: &str) -> Result<String> {
    let count = values.len() as u32;
    let points: Vec<(u32, f64)> = values
        .iter()
        .enumerate()
        .filter(|(_, v)| v.is_finite())
        .map(|(i, v)| (i as u32, *v))
        .collect();
    let max = points.iter().map(|(_, v)| *v).fold(0.0, f64::max);
    let min = points.iter().map(|(_, v)| *v).fold(0.0, f64::min);
    svg(chart, CHART_SIZE, |root| {
        let mut plot = ChartBuilder::on(root)
            .margin(12)
            .margin_right(20)
            .x_label_area_size(40)
            .y_label_area_size(66)
            .build_cartesian_2d(slots(count), min..axis_top(max))?;
        plot.configure_mesh()
            .light_line_style(TRANSPARENT)
            .bold_line_style(GRID)
            .axis_style(AXIS)
            .label_style(label_style(15))
            .axis_desc_style(label_style(15))
            .x_desc("round")
            .y_desc(y_desc)
            .x_labels(count as usize)
            .x_label_formatter(&|segment| match segment {
                SegmentValue::CenterOf(index) if *index < count => (index + 1).to_string(),
                _ => String::new(),
            })
            .y_labels(6)
            .y_label_formatter(&|value| format!("{value:.3}"))
            .draw()?;
        let at = |(index, value): &(u32, f64)| (SegmentValue::CenterOf(*index), *value);
        plot.draw_series(LineSeries::new(points.iter().map(at), LINE.stroke_width(2)))?;
        plot.draw_series(
            points
                .iter()
                .map(|point| Circle::new(at(point), 4, LINE.filled())),
        )?;
        // Value labels sit 8 px above their markers, clear of the line.
        plot.draw_series(points.iter().map(|point| {
            EmptyElement::at(at(point))
                + Text::new(
                    format!("{:.3}", point.1),
                    (0, -8),
                    label_style(14).pos(Pos::new(HPos::Center, VPos::Bottom)),
                )
        }))?;
        Ok(())
    })
}

/// A small line of a skill's PEMS history without axes, its last point marked.
pub(crate) fn sparkline(chart: &str, values: &[f64]) -> Result<String> {
    let points: Vec<(f64, f64)> = values
        .iter()
        .enumerate()
        .filter(|(_, v)| v.is_finite())
        .map(|(i, v)| (i as f64, *v))
        .collect();
    let last_x = points.last().map_or(0.0, |(x, _)| *x).max(1.0);
    let max = points.iter().map(|(_, v)| *v).fold(f64::MIN, f64::max);
    let min = points.iter().map(|(_, v)| *v).fold(f64::MAX, f64::min);
    let (low, high) = if points.is_empty() {
        (0.0, 1.0)
    } else if max - min < 1e-9 {
        (
            min - 0.5 * min.abs().max(1e-3),
            max + 0.5 * max.abs().max(1e-3),
        )
    } else {
        (min - 0.1 * (max - min), max + 0.1 * (max - min))
    };
    svg(chart, SPARKLINE_SIZE, |root| {
        let mut plot = ChartBuilder::on(root)
            .margin(5)
            .build_cartesian_2d(0.0..last_x, low..high)?;
        plot.draw_series(LineSeries::new(
            points.iter().copied(),
            LINE.stroke_width(2),
        ))?;
        plot.draw_series(
            points
                .last()
                .map(|point| Circle::new(*point, 3, LINE.filled())),
        )?;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_charts_are_deterministic_svg() {
        let bars = vec![("ingest".to_string(), 1.5), ("embed".to_string(), 12.25)];
        let first = horizontal_bars("stage timings", &bars, "s").unwrap();
        assert!(first.starts_with("<svg"), "{first}");
        assert!(
            first.contains(">\ningest\n"),
            "stage label missing: {first}"
        );
        assert_eq!(first, horizontal_bars("stage timings", &bars, "s").unwrap());
        let line = round_line("pems", &[0.1, f64::NAN, 0.3], "mean PEMS").unwrap();
        assert!(
            line.contains("<polyline") || line.contains("<path"),
            "{line}"
        );
        assert!(!line.contains("NaN"), "{line}");
    }

    #[test]
    fn report_degenerate_inputs_still_draw() {
        for values in [&[][..], &[0.2][..], &[0.2, 0.2][..], &[f64::NAN][..]] {
            let svg = sparkline("spark", values).unwrap();
            assert!(
                svg.starts_with("<svg") && !svg.contains("NaN"),
                "{values:?}: {svg}"
            );
        }
        assert!(vertical_bars("clusters", &[0, 0], 1, "cluster", "episodes")
            .unwrap()
            .starts_with("<svg"));
        assert!(horizontal_bars("timings", &[("x".into(), 0.0)], "s")
            .unwrap()
            .starts_with("<svg"));
        assert!(round_line("pems", &[0.2], "mean PEMS")
            .unwrap()
            .starts_with("<svg"));
        let many: Vec<u64> = (0..500).map(|i| 1_000_000_000 - i).collect();
        let svg = vertical_bars("clusters", &many, 1, "cluster", "episodes").unwrap();
        assert_eq!(
            svg.matches("fill=\"#3B6EA8\"").count(),
            500,
            "one bar per cluster"
        );
    }

    #[test]
    fn report_shorten_marks_the_cut() {
        assert_eq!(shorten("consolidate", 18), "consolidate");
        assert_eq!(shorten("abcdefghij", 5), "abcd…");
    }
}
