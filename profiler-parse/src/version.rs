//! .NET version strings as a target gives them (its runtime's
//! `ProcessInfo2` reply, the shared framework directory it maps, its
//! environment): only the major number is read.

/// The major number of a .NET version string: `"8.0.4"` -> 8,
/// `"9.0.0-preview.1+abc"` -> 9, `"3.1.23"` -> 3.
pub fn version_major(version: &str) -> Option<u32> {
    let digits = version.split(['.', '-', '+']).next()?;
    if digits.is_empty() || digits.len() > 4 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_majors() {
        assert_eq!(version_major("8.0.4"), Some(8));
        assert_eq!(version_major("10.0.0-preview.7.25380.108"), Some(10));
        assert_eq!(
            version_major("8.0.4+2d7eea252964e69be94cb9c847b371b23e4dd470"),
            Some(8)
        );
        assert_eq!(version_major("3"), Some(3));
        assert_eq!(version_major(""), None);
        assert_eq!(version_major("v8"), None);
        assert_eq!(version_major("99999999999.0"), None);
    }
}
