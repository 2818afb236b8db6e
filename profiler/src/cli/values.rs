//! Parsers of option values shared by `record` and `agent`: durations,
//! sizes, log filters. One parser per kind, so `-d 30s`, `--upload-interval
//! 15` and `--start-wait 2.5` follow the same rules.

use std::time::Duration;

/// The levels a log filter accepts.
pub const LOG_LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];

/// A duration: a plain number (of `bare_unit`, seconds for most options,
/// fractions allowed), or a number with a unit, `500ms`, `30s`, `2m`, `1h`,
/// or several, `1m30s` (humantime syntax). Never negative.
pub fn parse_duration_in(text: &str, bare_unit: Duration) -> Result<Duration, String> {
    let text = text.trim();
    if text.starts_with('-') {
        return Err("must not be negative".to_owned());
    }
    if let Ok(number) = text.parse::<f64>() {
        // A bare number: `30` or `2.5` of the option's unit. `inf` and
        // `nan` parse as floats too; they are not durations.
        return Duration::try_from_secs_f64(number * bare_unit.as_secs_f64())
            .map_err(|_| format!("`{text}` is not a duration (write 30, 30s, 2m or 500ms)"));
    }
    humantime::parse_duration(text)
        .map_err(|error| format!("{error} (write a duration like 30, 30s, 2m or 500ms)"))
}

/// A duration more than zero; a plain number is seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let duration = parse_duration_in(text, Duration::from_secs(1))?;
    if duration.is_zero() {
        return Err("must be more than zero".to_owned());
    }
    Ok(duration)
}

/// A duration from `min` to `max` (inclusive), in whole seconds if
/// `whole_seconds`; a plain number is seconds.
pub fn parse_duration_range(
    text: &str,
    min: Duration,
    max: Duration,
    whole_seconds: bool,
) -> Result<Duration, String> {
    let duration = parse_duration_in(text, Duration::from_secs(1))?;
    if !(min..=max).contains(&duration) {
        return Err(format!(
            "must be from {} to {}",
            humantime::format_duration(min),
            humantime::format_duration(max)
        ));
    }
    if whole_seconds && duration.subsec_nanos() != 0 {
        return Err("must be a whole number of seconds".to_owned());
    }
    Ok(duration)
}

/// A size: bytes, or a number with `KB`, `MB`, `GB` (powers of 1000) or
/// `KiB`, `MiB`, `GiB` (powers of 1024).
pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    if text.starts_with('-') {
        return Err("must not be negative".to_owned());
    }
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not a size (write 500MB, 2GiB or bytes)"))?;
    let multiplier: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1000,
        "mb" => 1000 * 1000,
        "gb" => 1000 * 1000 * 1000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        other => {
            return Err(format!(
                "unknown size unit `{other}` (use KB, MB, GB, KiB, MiB, GiB)"
            ));
        }
    };
    number
        .checked_mul(multiplier)
        .filter(|&bytes| bytes > 0)
        .ok_or_else(|| format!("`{text}` is zero or too large"))
}

/// A log filter: comma-separated directives, each a level (`warn`) or a
/// module path and a level (`clrbpf::agent=debug`). The subset of
/// tracing's `EnvFilter` syntax clrbpf documents; anything else (`bogus`,
/// which `EnvFilter` would take for a module name) is refused.
pub fn parse_log_filter(text: &str) -> Result<String, String> {
    let accepted = || {
        format!(
            "accepted: {}, or a list such as warn,clrbpf::agent=debug (from --log-level or CLRBPF_LOG)",
            LOG_LEVELS.join(", ")
        )
    };
    let text = text.trim();
    if text.is_empty() {
        return Err(format!("empty log level; {}", accepted()));
    }
    for directive in text.split(',') {
        let (target, level) = match directive.split_once('=') {
            Some((target, level)) => (Some(target), level),
            None => (None, directive),
        };
        let level_ok = LOG_LEVELS.contains(&level.to_ascii_lowercase().as_str());
        let target_ok = target.is_none_or(|target| {
            !target.is_empty()
                && target.split("::").all(|part| {
                    !part.is_empty()
                        && part
                            .bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
                })
        });
        if !(level_ok && target_ok) {
            return Err(format!("`{directive}` is not a log level; {}", accepted()));
        }
    }
    Ok(text.to_owned())
}
