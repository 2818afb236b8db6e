//! The SVG flame graph writer: the folded stacks of [`super::collapsed`]
//! drawn by `inferno` (a Rust port of Brendan Gregg's `flamegraph.pl`), an
//! interactive, self-contained SVG (search, zoom) for one sample type.
//!
//! Colours say where a frame's code came from, so a glance separates the
//! .NET code from the runtime and the kernel:
//!
//! - managed (JIT, ReadyToRun): green, kernel: orange, inlined: aqua. These
//!   come from inferno's `java` palette reading the `_[j]`, `_[k]` and `_[i]`
//!   annotations of the folded lines (the convention of async-profiler and
//!   `inferno-collapse-perf --all`); inferno strips them from the labels.
//! - native code: red, unsymbolized addresses: grey, process roots and
//!   frames the profiler adds: purple. Native frames carry no annotation,
//!   and the `java` palette would guess from the name (an upper-case
//!   initial or a `.` means Java to it, so `libcoreclr.so+0x12` would turn
//!   green like managed code), so these colours are fixed up front through
//!   inferno's palette map.
//!
//! - runtime (native code of the .NET runtime: libcoreclr, libclrjit, the
//!   host and the `System.*` native libraries): yellow, so time in the GC,
//!   the JIT or the type loader stands apart from the application's own
//!   native code.
//!
//! Shades within a colour come from a hash of the name, so a function keeps
//! its colour from one graph to the next.
//!
//! The title says what the graph measures; the subtitle which processes,
//! over how long, at what rate and when; a legend on the subtitle's line
//! names the colours. [`FlameGraphOptions`] carries `record`'s
//! `--title`, `--reverse`, `--inverted`, `--per-thread` and `--min-width`,
//! which map onto inferno's own options.

use std::{
    collections::BTreeMap,
    io::Write,
    time::{Duration, UNIX_EPOCH},
};

use inferno::flamegraph::{
    self, Direction, Options, Palette,
    color::{BackgroundColor, Color, MultiPalette, PaletteMap},
};

use super::{
    ExportError, check_sample_type_index,
    collapsed::{self, Roots, UNKNOWN},
};
use crate::profile::{FrameKind, LabelValue, Module, Profile, label_keys};

/// How `record` draws its flame graph; the default is inferno's default
/// view with the generated title.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FlameGraphOptions {
    /// Replaces the generated title (`--title`).
    pub title: Option<String>,
    /// Stacks leaf first, so the hottest functions are the roots and their
    /// callers grow above them (inferno's `--reverse`).
    pub reverse: bool,
    /// An icicle graph: roots at the top (inferno's `--inverted`).
    pub inverted: bool,
    /// A tower per thread under each process (`[name tid=N]` frames).
    pub per_thread: bool,
    /// Frames narrower than this percentage of the graph's width are left
    /// out (inferno's `--minwidth`; its default, 0.01 %, when `None`).
    pub min_width: Option<f64>,
}

/// Most processes the subtitle names; the rest are counted.
const SUBTITLE_PROCESSES: usize = 3;

/// Most characters of a name in the subtitle, so the line stays clear of
/// the legend drawn on its left.
const SUBTITLE_NAME_CHARS: usize = 24;

/// The legend: each colour and what it means, in the order drawn.
const LEGEND: &[(&str, Color)] = &[
    (
        "managed",
        Color {
            r: 50,
            g: 200,
            b: 50,
        },
    ),
    (
        "native",
        Color {
            r: 230,
            g: 90,
            b: 90,
        },
    ),
    (
        "runtime",
        Color {
            r: 225,
            g: 210,
            b: 60,
        },
    ),
    (
        "kernel",
        Color {
            r: 230,
            g: 140,
            b: 0,
        },
    ),
    (
        "inlined",
        Color {
            r: 80,
            g: 200,
            b: 200,
        },
    ),
];

/// Native libraries of the .NET runtime and its host, by file name prefix.
const RUNTIME_LIBRARIES: &[&str] = &[
    "libcoreclr",
    "libclrjit",
    "libclrgc",
    "libhostfxr",
    "libhostpolicy",
    "libmscordaccore",
    "libmscordbi",
    "libSystem.",
    "libMicrosoft.",
];

/// The text an empty flame graph shows instead of frames.
const NO_SAMPLES: &str = "no samples";

/// Writes an SVG flame graph of `profile`, sized by the sample type at
/// `sample_type_index`. A profile without samples (inferno refuses those)
/// gives a small valid SVG that says "no samples".
pub fn write_flamegraph(
    profile: &Profile,
    sample_type_index: usize,
    w: impl Write,
) -> Result<(), ExportError> {
    write_flamegraph_with(profile, sample_type_index, &FlameGraphOptions::default(), w)
}

/// [`write_flamegraph`] drawn as `view` asks.
pub fn write_flamegraph_with(
    profile: &Profile,
    sample_type_index: usize,
    view: &FlameGraphOptions,
    mut w: impl Write,
) -> Result<(), ExportError> {
    check_sample_type_index(profile, sample_type_index)?;
    let sample_type = &profile.sample_types[sample_type_index];
    let title = view
        .title
        .clone()
        .unwrap_or_else(|| format!("{} ({})", sample_type.r#type, sample_type.unit));
    let write_error = |source| ExportError::Write {
        what: "flame graph",
        source,
    };

    let roots = if view.per_thread {
        Roots::Thread
    } else {
        Roots::Process
    };
    let stacks = collapsed::folded_stacks_by(profile, sample_type_index, roots)?;
    if stacks.is_empty() {
        write_empty_svg(&title, &mut w).map_err(write_error)?;
        return w.flush().map_err(write_error);
    }
    let lines: Vec<String> = stacks
        .iter()
        .map(|(stack, value)| format!("{stack} {value}"))
        .collect();

    let mut palette_map = kind_palette(profile, roots);
    let mut options = Options::default();
    options.title = title;
    options.subtitle = Some(subtitle(profile));
    options.reverse_stack_order = view.reverse;
    if view.inverted {
        options.direction = Direction::Inverted;
    }
    if let Some(min_width) = view.min_width {
        options.min_width = min_width;
    }
    // "12 samples", "3 contentions", but "1,000,000 nanoseconds".
    options.count_name = if &*sample_type.unit == "count" {
        sample_type.r#type.to_string()
    } else {
        sample_type.unit.to_string()
    };
    options.colors = Palette::Multi(MultiPalette::Java);
    // Grey, not the java palette's yellow, so runtime frames stand out.
    options.bgcolors = Some(BackgroundColor::Grey);
    options.hash = true;
    options.palette_map = Some(&mut palette_map);
    let mut svg = Vec::new();
    flamegraph::from_lines(&mut options, lines.iter().map(String::as_str), &mut svg)
        .map_err(write_error)?;
    let svg = with_legend(svg, options.font_size);
    w.write_all(&svg).map_err(write_error)?;
    w.flush().map_err(write_error)
}

/// `3 processes: dotnet (pid 42), ... · 5.0 s at 99 Hz · 8 samples ·
/// 2023-11-14 22:13:20 UTC`: which processes, how long, how often, when.
fn subtitle(profile: &Profile) -> String {
    let mut parts = vec![processes(profile)];
    let duration = Duration::from_nanos(u64::try_from(profile.duration_ns).unwrap_or(0));
    let mut span = format!("{:.1} s", duration.as_secs_f64());
    let per_second = profile
        .period_type
        .as_ref()
        .filter(|period| &*period.unit == "nanoseconds" && profile.period > 0);
    if per_second.is_some() {
        span.push_str(&format!(" at {:.0} Hz", 1e9 / profile.period as f64));
    }
    parts.push(span);
    if let Some(index) = samples_index(profile) {
        let total = profile
            .samples
            .iter()
            .filter_map(|sample| sample.values.get(index))
            .fold(0i64, |sum, &value| sum.saturating_add(value.max(0)));
        parts.push(format!("{} samples", thousands(total)));
    }
    if let Some(start) = u64::try_from(profile.start_unix_ns)
        .ok()
        .filter(|&ns| ns > 0)
        .and_then(|ns| UNIX_EPOCH.checked_add(Duration::from_nanos(ns)))
    {
        let when = humantime::format_rfc3339_seconds(start).to_string();
        parts.push(format!(
            "{} UTC",
            when.trim_end_matches('Z').replacen('T', " ", 1)
        ));
    }
    parts.join(" · ")
}

/// `dotnet (pid 42)`, or `3 processes: a (pid 1), b (pid 2), c (pid 3)`,
/// or `12 processes: a, b, c and 9 more`, busiest first.
fn processes(profile: &Profile) -> String {
    let samples_index = samples_index(profile);
    let mut weights: BTreeMap<(String, Option<i64>), i64> = BTreeMap::new();
    for sample in &profile.samples {
        let mut name = None;
        let mut pid = None;
        for label in &sample.labels {
            match (&*label.key, &label.value) {
                (label_keys::PROCESS_EXECUTABLE_NAME, LabelValue::Str(value)) => {
                    name = Some(value.clone());
                }
                (label_keys::PROCESS_PID, LabelValue::Num { value, .. }) => pid = Some(*value),
                _ => {}
            }
        }
        let mut short = String::new();
        collapsed::push_name(&mut short, name.as_deref().unwrap_or(UNKNOWN));
        if short.chars().count() > SUBTITLE_NAME_CHARS {
            short = short.chars().take(SUBTITLE_NAME_CHARS - 1).collect();
            short.push('…');
        }
        let count = samples_index
            .and_then(|index| sample.values.get(index).copied())
            .unwrap_or(1)
            .max(0);
        let weight = weights.entry((short, pid)).or_default();
        *weight = weight.saturating_add(count);
    }
    let mut busiest: Vec<_> = weights.into_iter().collect();
    busiest.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let named = |((name, pid), _): &((String, Option<i64>), i64)| match pid {
        Some(pid) => format!("{name} (pid {pid})"),
        None => name.clone(),
    };
    match busiest.len() {
        0 => "no process".to_owned(),
        1 => named(&busiest[0]),
        count if count <= SUBTITLE_PROCESSES => format!(
            "{count} processes: {}",
            busiest.iter().map(named).collect::<Vec<_>>().join(", ")
        ),
        count => format!(
            "{count} processes: {} and {} more",
            busiest[..SUBTITLE_PROCESSES]
                .iter()
                .map(|((name, _), _)| name.clone())
                .collect::<Vec<_>>()
                .join(", "),
            count - SUBTITLE_PROCESSES
        ),
    }
}

/// The index of the `samples/count` sample type.
fn samples_index(profile: &Profile) -> Option<usize> {
    profile
        .sample_types
        .iter()
        .position(|t| &*t.r#type == "samples" && &*t.unit == "count")
}

/// `1234567` as `1,234,567`.
fn thousands(value: i64) -> String {
    let digits = value.unsigned_abs().to_string();
    let mut out = String::new();
    for (index, digit) in digits.chars().enumerate() {
        if index > 0 && (digits.len() - index).is_multiple_of(3) {
            out.push(',');
        }
        out.push(digit);
    }
    if value < 0 {
        out.insert(0, '-');
    }
    out
}

/// Draws the colour legend on the subtitle's line, at the left (inferno
/// has none): inserted after the subtitle element, which inferno always
/// writes when a subtitle is set. Unchanged if there is none.
fn with_legend(svg: Vec<u8>, font_size: usize) -> Vec<u8> {
    // inferno writes UTF-8 (quick-xml over `&str`s); anything else is
    // left as it is.
    let text = match String::from_utf8(svg) {
        Ok(text) => text,
        Err(error) => return error.into_bytes(),
    };
    let Some(at) = text.find(r#"id="subtitle""#).and_then(|subtitle| {
        text[subtitle..]
            .find("</text>")
            .map(|end| subtitle + end + 7)
    }) else {
        return text.into_bytes();
    };
    let y = font_size * 4;
    let mut legend = String::from(r#"<g id="legend">"#);
    let mut x = 10;
    for (name, color) in LEGEND {
        legend.push_str(&format!(
            r#"<rect x="{x}" y="{top}" width="{font_size}" height="{font_size}" fill="rgb({r},{g},{b})" rx="2" ry="2"/><text x="{tx}" y="{y}" text-anchor="start">{name}</text>"#,
            top = y - font_size + 2,
            r = color.r,
            g = color.g,
            b = color.b,
            tx = x + font_size + 4,
        ));
        x += font_size + 10 + name.len() * 8;
    }
    legend.push_str("</g>");
    let mut out = text;
    out.insert_str(at, &legend);
    out.into_bytes()
}

/// Fixed colours for the frames the `java` palette cannot classify (see the
/// module doc), keyed by their folded text.
fn kind_palette(profile: &Profile, roots: Roots) -> PaletteMap {
    let mut palette = PaletteMap::default();
    for frame in &profile.frames {
        let color = match frame.kind {
            FrameKind::Native if frame.module.as_deref().is_some_and(is_runtime) => yellow,
            FrameKind::Native => red,
            FrameKind::Unknown => grey,
            FrameKind::Synthetic => purple,
            // Annotated: the java palette colours them.
            FrameKind::Kernel | FrameKind::Managed => continue,
        };
        let mut name = String::new();
        collapsed::push_name(&mut name, &frame.name);
        let shade = color(name_hash(&name));
        palette.insert(name, shade);
    }
    for label in profile.samples.iter().flat_map(|sample| &sample.labels) {
        if let (label_keys::PROCESS_EXECUTABLE_NAME, LabelValue::Str(executable)) =
            (&*label.key, &label.value)
        {
            let mut name = String::new();
            collapsed::push_name(&mut name, executable);
            if palette.get(&name).is_none() {
                let shade = purple(name_hash(&name));
                palette.insert(name, shade);
            }
        }
    }
    if roots == Roots::Thread {
        for sample in &profile.samples {
            let mut name = String::new();
            collapsed::push_thread(&mut name, sample);
            let shade = purple(name_hash(&name));
            palette.insert(name, shade);
        }
    }
    palette.insert(UNKNOWN, grey(name_hash(UNKNOWN)));
    palette
}

/// Whether `module` is a native library of the .NET runtime.
fn is_runtime(module: &Module) -> bool {
    let file = module.path.rsplit('/').next().unwrap_or_default();
    RUNTIME_LIBRARIES
        .iter()
        .any(|prefix| file.starts_with(prefix))
}

/// A stable value in `[0, 1)` from a name (FNV-1a), for shades.
fn name_hash(name: &str) -> f32 {
    let hash = name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    });
    // The top 24 bits fit an f32 exactly.
    (hash >> 40) as f32 / (1u64 << 24) as f32
}

/// `base + span * v`, the shade formula of flamegraph.pl's palettes.
fn shade(base: u8, span: u8, v: f32) -> u8 {
    base.saturating_add((f32::from(span) * v) as u8)
}

fn red(v: f32) -> Color {
    Color {
        r: shade(200, 55, v),
        g: shade(50, 80, v),
        b: shade(50, 80, v),
    }
}

fn yellow(v: f32) -> Color {
    Color {
        r: shade(205, 50, v),
        g: shade(190, 50, v),
        b: shade(40, 40, v),
    }
}

fn grey(v: f32) -> Color {
    let level = shade(170, 40, v);
    Color {
        r: level,
        g: level,
        b: level,
    }
}

fn purple(v: f32) -> Color {
    Color {
        r: shade(190, 65, v),
        g: shade(80, 60, v),
        b: shade(190, 65, v),
    }
}

/// The SVG for a profile without samples: the title and "no samples".
fn write_empty_svg(title: &str, w: &mut impl Write) -> std::io::Result<()> {
    write!(
        w,
        concat!(
            r#"<?xml version="1.0" standalone="no"?>"#,
            "\n",
            r#"<svg version="1.1" width="1200" height="66" viewBox="0 0 1200 66" xmlns="http://www.w3.org/2000/svg">"#,
            r#"<rect x="0" y="0" width="100%" height="100%" fill="rgb(238,238,238)"/>"#,
            r#"<text x="600" y="24" text-anchor="middle" font-family="Verdana" font-size="17">{title}</text>"#,
            r#"<text x="600" y="50" text-anchor="middle" font-family="Verdana" font-size="12">{no_samples}</text>"#,
            "</svg>\n",
        ),
        title = xml_escape(title),
        no_samples = NO_SAMPLES,
    )
}

fn xml_escape(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => escaped.push_str("&amp;"),
            '<' => escaped.push_str("&lt;"),
            '>' => escaped.push_str("&gt;"),
            '"' => escaped.push_str("&quot;"),
            '\'' => escaped.push_str("&apos;"),
            // Not allowed in XML 1.0 at all.
            c if c.is_control() && !matches!(c, '\t' | '\n' | '\r') => escaped.push(' '),
            c => escaped.push(c),
        }
    }
    escaped
}

#[cfg(test)]
mod tests {
    use quick_xml::{Reader, events::Event};

    use super::*;
    use crate::{
        export::test_profile,
        profile::{Frame, ProfileSample, ValueType},
    };

    fn render(profile: &Profile, index: usize) -> String {
        let mut out = Vec::new();
        write_flamegraph(profile, index, &mut out).unwrap();
        let svg = String::from_utf8(out).unwrap();
        assert_well_formed(&svg);
        svg
    }

    /// Parses the whole document: names of end tags match, every element
    /// is closed, there is exactly one root `<svg>`.
    fn assert_well_formed(svg: &str) {
        let mut reader = Reader::from_str(svg);
        let mut open: Vec<String> = Vec::new();
        let mut roots = 0;
        loop {
            match reader.read_event() {
                Ok(Event::Start(start)) => {
                    let name = String::from_utf8(start.name().as_ref().to_vec()).unwrap();
                    if open.is_empty() {
                        assert_eq!(name, "svg");
                        roots += 1;
                    }
                    open.push(name);
                }
                Ok(Event::End(end)) => {
                    let name = open.pop().expect("end tag without a start tag");
                    assert_eq!(name.as_bytes(), end.name().as_ref());
                }
                Ok(Event::Empty(_)) => assert!(!open.is_empty(), "element outside <svg>"),
                Ok(Event::Eof) => break,
                Ok(_) => {}
                Err(error) => panic!("invalid XML at {}: {error}", reader.error_position()),
            }
        }
        assert!(open.is_empty(), "unclosed elements: {open:?}");
        assert_eq!(roots, 1);
    }

    #[test]
    fn shows_every_frame_name_once_deannotated() {
        let svg = render(&test_profile::profile(), 1);
        for name in [
            "dotnet",
            "App.Main",
            "Hot.Spin",
            "__GI___libc_write",
            "__write_nocancel",
            "entry_SYSCALL_64",
            "do_syscall_64",
            "libcoreclr.so+0x1234",
            "evil:name with  controls",
            "[truncated]",
        ] {
            assert!(svg.contains(&format!("<title>{name} (")), "{name}");
        }
        assert!(!svg.contains("_[j]") && !svg.contains("_[k]") && !svg.contains("_[i]"));
        // The tiers of Spin are one frame: 60 ms of 80 ms.
        assert!(svg.contains("Hot.Spin (60,000,000 nanoseconds, 75.00%)"));
        assert!(svg.contains("cpu (nanoseconds)"));
    }

    #[test]
    fn count_units_use_the_type_as_count_name() {
        let svg = render(&test_profile::profile(), 0);
        assert!(svg.contains("do_syscall_64 (2 samples, "), "{svg}");
        assert!(svg.contains("samples (count)"));
    }

    #[test]
    fn xml_special_characters_are_escaped() {
        let mut profile = test_profile::profile();
        profile
            .frames
            .push(Frame::synthetic("List<T>::Add(T) & \"more\" 'x'"));
        profile.samples.push(ProfileSample {
            stack: vec![(profile.frames.len() - 1) as u32],
            // Wide enough for inferno to draw it.
            values: vec![1, 80_000_000],
            labels: Vec::new(),
        });
        let svg = render(&profile, 1);
        assert!(svg.contains("List&lt;T&gt;::Add(T) &amp;"), "{svg}");
    }

    #[test]
    fn empty_profile_says_no_samples() {
        let mut profile = test_profile::profile();
        profile.samples.clear();
        profile.sample_types[1] = ValueType::new("cpu<&>", "nanoseconds");
        let svg = render(&profile, 1);
        assert!(svg.contains(">no samples<"));
        assert!(svg.contains("cpu&lt;&amp;&gt; (nanoseconds)"));
        // All values zero is empty too.
        let mut profile = test_profile::profile();
        profile.samples.iter_mut().for_each(|s| s.values[0] = 0);
        assert!(render(&profile, 0).contains(">no samples<"));
    }

    #[test]
    fn out_of_range_sample_type_is_an_error() {
        let result = write_flamegraph(&test_profile::profile(), 5, Vec::new());
        assert!(matches!(
            result,
            Err(ExportError::SampleTypeOutOfRange { index: 5, count: 2 })
        ));
    }

    /// The fill of the rectangle drawn for `name`.
    fn fill_of(svg: &str, name: &str) -> Color {
        let start = svg.find(&format!("<title>{name} (")).expect(name);
        let rest = &svg[start..];
        let fill = &rest[rest.find("fill=\"rgb(").expect("fill") + 10..];
        let parts: Vec<u8> = fill[..fill.find(')').unwrap()]
            .split(',')
            .map(|part| part.parse().unwrap())
            .collect();
        Color {
            r: parts[0],
            g: parts[1],
            b: parts[2],
        }
    }

    #[test]
    fn colours_follow_the_frame_kind() {
        let svg = render(&test_profile::profile(), 1);
        let is_green = |c: Color| c.g > c.r && c.g > c.b;
        let is_orange = |c: Color| c.r > c.g && c.g > c.b && c.b == 0;
        let is_red = |c: Color| c.r >= 200 && c.g == c.b && c.g < c.r;
        let is_grey = |c: Color| c.r == c.g && c.g == c.b;
        let is_purple = |c: Color| c.r == c.b && c.g < c.r;
        let is_aqua = |c: Color| c.g == c.b && c.r < c.g;
        assert!(is_green(fill_of(&svg, "Hot.Spin")));
        assert!(is_orange(fill_of(&svg, "do_syscall_64")));
        assert!(is_aqua(fill_of(&svg, "__write_nocancel")));
        assert!(is_red(fill_of(&svg, "__GI___libc_write")));
        assert!(is_grey(fill_of(&svg, "libcoreclr.so+0x1234")));
        assert!(is_purple(fill_of(&svg, "[truncated]")));
        assert!(is_purple(fill_of(&svg, "dotnet")));
        assert!(is_grey(fill_of(&svg, "[unknown]")));
        // Stable from one graph to the next.
        let again = render(&test_profile::profile(), 1);
        assert_eq!(
            fill_of(&svg, "__GI___libc_write"),
            fill_of(&again, "__GI___libc_write")
        );
    }

    fn render_with(profile: &Profile, view: &FlameGraphOptions) -> String {
        let mut out = Vec::new();
        write_flamegraph_with(profile, 1, view, &mut out).unwrap();
        let svg = String::from_utf8(out).unwrap();
        assert_well_formed(&svg);
        svg
    }

    #[test]
    fn title_subtitle_and_legend() {
        let svg = render(&test_profile::profile(), 1);
        assert!(svg.contains(r#"id="title""#) && svg.contains(">cpu (nanoseconds)</text>"));
        let subtitle = "3 processes: dotnet (pid 42), [unknown] (pid 99), my:app (pid 7) \
                        · 5.0 s at 99 Hz · 8 samples · 2023-11-14 22:13:20 UTC";
        assert!(svg.contains(&format!(">{subtitle}</text>")), "{svg}");
        let legend = &svg[svg.find(r#"<g id="legend">"#).expect("legend")..];
        let legend = &legend[..legend.find("</g>").unwrap()];
        for (name, color) in LEGEND {
            assert!(legend.contains(&format!(">{name}</text>")), "{name}");
            let fill = format!("fill=\"rgb({},{},{})\"", color.r, color.g, color.b);
            assert!(legend.contains(&fill), "{name}");
        }
        let custom = FlameGraphOptions {
            title: Some("Checkout <slow> path".to_owned()),
            ..FlameGraphOptions::default()
        };
        assert!(
            render_with(&test_profile::profile(), &custom)
                .contains(">Checkout &lt;slow&gt; path</text>")
        );
    }

    #[test]
    fn subtitle_counts_the_processes_beyond_three() {
        let mut profile = test_profile::profile();
        for pid in 1..=4 {
            let mut sample = profile.samples[1].clone();
            sample.labels = vec![
                crate::profile::Label::num(label_keys::PROCESS_PID, pid),
                crate::profile::Label::str(
                    label_keys::PROCESS_EXECUTABLE_NAME,
                    "a-very-long-executable-name-indeed",
                ),
            ];
            profile.samples.push(sample);
        }
        profile.period_type = None;
        let text = subtitle(&profile);
        assert!(
            text.starts_with(
                "7 processes: dotnet, [unknown], a-very-long-executable-… and 4 more · 5.0 s · "
            ),
            "{text}"
        );
        assert_eq!(thousands(1_234_567), "1,234,567");
        assert_eq!(thousands(-1_000), "-1,000");
        assert_eq!(thousands(999), "999");
    }

    #[test]
    fn reverse_puts_the_leaves_at_the_base() {
        let profile = test_profile::profile();
        let normal = render_with(&profile, &FlameGraphOptions::default());
        assert!(normal.contains("<title>Hot.Spin (60,000,000 nanoseconds, 75.00%)"));
        let reversed = render_with(
            &profile,
            &FlameGraphOptions {
                reverse: true,
                ..FlameGraphOptions::default()
            },
        );
        // As a root, Spin is only the samples where it is the leaf.
        assert!(
            reversed.contains("<title>Hot.Spin (40,000,000 nanoseconds, 50.00%)"),
            "{reversed}"
        );
    }

    #[test]
    fn inverted_per_thread_and_min_width() {
        let profile = test_profile::profile();
        let inverted = render_with(
            &profile,
            &FlameGraphOptions {
                inverted: true,
                ..FlameGraphOptions::default()
            },
        );
        assert!(inverted.contains("var inverted = true;"));
        assert!(render(&profile, 1).contains("var inverted = false;"));

        let threads = render_with(
            &profile,
            &FlameGraphOptions {
                per_thread: true,
                ..FlameGraphOptions::default()
            },
        );
        let is_purple = |c: Color| c.r == c.b && c.g < c.r;
        assert!(is_purple(fill_of(&threads, "[.NET TP Worker tid=43]")));
        assert!(threads.contains("<title>[tid=44] (10,000,000 nanoseconds, 12.50%)"));

        // 20 ms of 80 ms is 25 %: left out at 30.
        let narrow = FlameGraphOptions {
            min_width: Some(30.0),
            ..FlameGraphOptions::default()
        };
        let wide_only = render_with(&profile, &narrow);
        assert!(!wide_only.contains("<title>do_syscall_64 ("));
        assert!(wide_only.contains("<title>Hot.Spin ("), "{wide_only}");
    }

    #[test]
    fn runtime_frames_are_yellow() {
        let mut profile = test_profile::profile();
        let mut gc = profile.frames[test_profile::LIBC_WRITE as usize].clone();
        gc.name = "WKS::gc_heap::mark_phase".into();
        gc.inlined.clear();
        gc.module = profile.frames[test_profile::CORECLR_UNKNOWN as usize]
            .module
            .clone();
        profile.frames.push(gc);
        profile.samples.push(ProfileSample {
            stack: vec![(profile.frames.len() - 1) as u32, test_profile::MAIN],
            values: vec![1, 40_000_000],
            labels: Vec::new(),
        });
        let svg = render(&profile, 1);
        let is_yellow = |c: Color| c.r > c.b + 100 && c.g > c.b + 100;
        assert!(is_yellow(fill_of(&svg, "WKS::gc_heap::mark_phase")));
        assert!(!is_yellow(fill_of(&svg, "__GI___libc_write")));
    }

    #[test]
    fn name_hash_is_in_range() {
        for name in ["", "a", "a much longer name with spaces", "ünïcode"] {
            let v = name_hash(name);
            assert!((0.0..1.0).contains(&v), "{name}: {v}");
        }
    }
}
