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
//! Shades within a colour come from a hash of the name, so a function keeps
//! its colour from one graph to the next.

use std::io::Write;

use inferno::flamegraph::{
    self, Options, Palette,
    color::{Color, MultiPalette, PaletteMap},
};

use super::{
    ExportError, check_sample_type_index,
    collapsed::{self, UNKNOWN},
};
use crate::profile::{FrameKind, LabelValue, Profile, label_keys};

/// The text an empty flame graph shows instead of frames.
const NO_SAMPLES: &str = "no samples";

/// Writes an SVG flame graph of `profile`, sized by the sample type at
/// `sample_type_index`. A profile without samples (inferno refuses those)
/// gives a small valid SVG that says "no samples".
pub fn write_flamegraph(
    profile: &Profile,
    sample_type_index: usize,
    mut w: impl Write,
) -> Result<(), ExportError> {
    check_sample_type_index(profile, sample_type_index)?;
    let sample_type = &profile.sample_types[sample_type_index];
    let title = format!("{} ({})", sample_type.r#type, sample_type.unit);
    let write_error = |source| ExportError::Write {
        what: "flame graph",
        source,
    };

    let stacks = collapsed::folded_stacks(profile, sample_type_index)?;
    if stacks.is_empty() {
        write_empty_svg(&title, &mut w).map_err(write_error)?;
        return w.flush().map_err(write_error);
    }
    let lines: Vec<String> = stacks
        .iter()
        .map(|(stack, value)| format!("{stack} {value}"))
        .collect();

    let mut palette_map = kind_palette(profile);
    let mut options = Options::default();
    options.title = title;
    // "12 samples", "3 contentions", but "1,000,000 nanoseconds".
    options.count_name = if &*sample_type.unit == "count" {
        sample_type.r#type.to_string()
    } else {
        sample_type.unit.to_string()
    };
    options.colors = Palette::Multi(MultiPalette::Java);
    options.hash = true;
    options.palette_map = Some(&mut palette_map);
    flamegraph::from_lines(&mut options, lines.iter().map(String::as_str), &mut w)
        .map_err(write_error)?;
    w.flush().map_err(write_error)
}

/// Fixed colours for the frames the `java` palette cannot classify (see the
/// module doc), keyed by their folded text.
fn kind_palette(profile: &Profile) -> PaletteMap {
    let mut palette = PaletteMap::default();
    for frame in &profile.frames {
        let color = match frame.kind {
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
    palette.insert(UNKNOWN, grey(name_hash(UNKNOWN)));
    palette
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

    #[test]
    fn name_hash_is_in_range() {
        for name in ["", "a", "a much longer name with spaces", "ünïcode"] {
            let v = name_hash(name);
            assert!((0.0..1.0).contains(&v), "{name}: {v}");
        }
    }
}
