//! Bounds-checked little-endian reads over a byte slice: the only way the
//! nettrace parser and the CLR event decoders touch bytes that came from a
//! target process. Every read either returns a value that lies inside the
//! slice or a [`ReadError`]; nothing here can panic or read out of bounds.

use thiserror::Error;

/// Why a read from a nettrace block or an event payload failed.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum ReadError {
    #[error("{field}: needs {needed} bytes at offset {offset}, {available} available")]
    Truncated {
        field: &'static str,
        offset: usize,
        needed: usize,
        available: usize,
    },
    #[error("{field}: variable-length integer at offset {offset} overflows {bits} bits")]
    VarintOverflow {
        field: &'static str,
        offset: usize,
        bits: u32,
    },
    #[error("{field}: UTF-16 string at offset {offset} has no terminating NUL")]
    UnterminatedString { field: &'static str, offset: usize },
}

/// A cursor over a byte slice. Field names travel into the errors so a
/// malformed stream says which field broke.
#[derive(Clone, Debug)]
pub struct ByteReader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> ByteReader<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Self { data, pos: 0 }
    }

    pub fn pos(&self) -> usize {
        self.pos
    }

    pub fn remaining(&self) -> usize {
        self.data.len() - self.pos
    }

    pub fn is_empty(&self) -> bool {
        self.remaining() == 0
    }

    /// The next `len` bytes, consumed.
    pub fn bytes(&mut self, len: usize, field: &'static str) -> Result<&'a [u8], ReadError> {
        let available = self.remaining();
        if len > available {
            return Err(ReadError::Truncated {
                field,
                offset: self.pos,
                needed: len,
                available,
            });
        }
        let start = self.pos;
        self.pos += len;
        Ok(&self.data[start..self.pos])
    }

    pub fn skip(&mut self, len: usize, field: &'static str) -> Result<(), ReadError> {
        self.bytes(len, field).map(|_| ())
    }

    fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], ReadError> {
        let bytes = self.bytes(N, field)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    pub fn u8(&mut self, field: &'static str) -> Result<u8, ReadError> {
        Ok(self.array::<1>(field)?[0])
    }

    pub fn u16(&mut self, field: &'static str) -> Result<u16, ReadError> {
        self.array(field).map(u16::from_le_bytes)
    }

    pub fn u32(&mut self, field: &'static str) -> Result<u32, ReadError> {
        self.array(field).map(u32::from_le_bytes)
    }

    pub fn u64(&mut self, field: &'static str) -> Result<u64, ReadError> {
        self.array(field).map(u64::from_le_bytes)
    }

    pub fn i64(&mut self, field: &'static str) -> Result<i64, ReadError> {
        self.array(field).map(i64::from_le_bytes)
    }

    pub fn f64(&mut self, field: &'static str) -> Result<f64, ReadError> {
        self.array(field).map(f64::from_le_bytes)
    }

    pub fn guid(&mut self, field: &'static str) -> Result<[u8; 16], ReadError> {
        self.array(field)
    }

    /// Unsigned LEB128, at most 10 bytes, rejecting bits beyond 64.
    pub fn varuint64(&mut self, field: &'static str) -> Result<u64, ReadError> {
        let start = self.pos;
        let mut value = 0u64;
        for index in 0..10u32 {
            let byte = self.u8(field)?;
            let bits = u64::from(byte & 0x7f);
            let shift = index * 7;
            // The 10th byte may only carry the top bit of a u64.
            if index == 9 && bits > 1 {
                return Err(ReadError::VarintOverflow {
                    field,
                    offset: start,
                    bits: 64,
                });
            }
            value |= bits << shift;
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(ReadError::VarintOverflow {
            field,
            offset: start,
            bits: 64,
        })
    }

    /// Unsigned LEB128 that must fit 32 bits (at most 5 bytes).
    pub fn varuint32(&mut self, field: &'static str) -> Result<u32, ReadError> {
        let start = self.pos;
        let mut value = 0u32;
        for index in 0..5u32 {
            let byte = self.u8(field)?;
            let bits = u32::from(byte & 0x7f);
            if index == 4 && bits > 0x0f {
                return Err(ReadError::VarintOverflow {
                    field,
                    offset: start,
                    bits: 32,
                });
            }
            value |= bits << (index * 7);
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err(ReadError::VarintOverflow {
            field,
            offset: start,
            bits: 32,
        })
    }

    /// A NUL-terminated UTF-16LE string. The whole string is consumed
    /// whatever its length (the fields after it must stay aligned), but only
    /// its first `max_units` code units are decoded; invalid UTF-16 becomes
    /// U+FFFD.
    pub fn utf16z(&mut self, max_units: usize, field: &'static str) -> Result<String, ReadError> {
        let start = self.pos;
        let rest = &self.data[self.pos..];
        let units = rest.chunks_exact(2).position(|unit| unit == [0, 0]).ok_or(
            ReadError::UnterminatedString {
                field,
                offset: start,
            },
        )?;
        self.pos += units * 2 + 2;
        let text = &rest[..units.min(max_units) * 2];
        Ok(decode_utf16_lossy(text))
    }
}

impl ByteReader<'_> {
    /// Steps over a NUL-terminated UTF-16LE string without decoding it.
    pub fn skip_utf16z(&mut self, field: &'static str) -> Result<(), ReadError> {
        let start = self.pos;
        let units = self.data[self.pos..]
            .chunks_exact(2)
            .position(|unit| unit == [0, 0])
            .ok_or(ReadError::UnterminatedString {
                field,
                offset: start,
            })?;
        self.pos += units * 2 + 2;
        Ok(())
    }
}

/// Decode UTF-16LE bytes (an even count) with U+FFFD for unpaired
/// surrogates. Plain ASCII, the common case for type and method names, takes
/// a fast path.
pub fn decode_utf16_lossy(bytes: &[u8]) -> String {
    let units = bytes
        .chunks_exact(2)
        .map(|pair| u16::from_le_bytes([pair[0], pair[1]]));
    if units.clone().all(|unit| unit < 0x80) {
        return units.map(|unit| char::from(unit as u8)).collect();
    }
    char::decode_utf16(units)
        .map(|unit| unit.unwrap_or(char::REPLACEMENT_CHARACTER))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_width_reads_are_little_endian_and_bounded() {
        let data = [1, 2, 3, 4, 5, 6, 7, 8, 9];
        let mut reader = ByteReader::new(&data);
        assert_eq!(reader.u16("a").unwrap(), 0x0201);
        assert_eq!(reader.u32("b").unwrap(), 0x0605_0403);
        assert_eq!(reader.remaining(), 3);
        let err = reader.u64("c").unwrap_err();
        assert_eq!(
            err,
            ReadError::Truncated {
                field: "c",
                offset: 6,
                needed: 8,
                available: 3
            }
        );
        // A failed read consumes nothing.
        assert_eq!(reader.pos(), 6);
        assert_eq!(
            reader.u32("d").unwrap_err().to_string(),
            "d: needs 4 bytes at offset 6, 3 available"
        );
    }

    #[test]
    fn varints_decode_and_reject_overflow() {
        let mut reader = ByteReader::new(&[0x7f, 0x80, 0x01, 0xe5, 0x8e, 0x26]);
        assert_eq!(reader.varuint32("a").unwrap(), 127);
        assert_eq!(reader.varuint32("b").unwrap(), 128);
        assert_eq!(reader.varuint64("c").unwrap(), 624_485);

        let max32 = [0xff, 0xff, 0xff, 0xff, 0x0f];
        assert_eq!(ByteReader::new(&max32).varuint32("m").unwrap(), u32::MAX);
        let over32 = [0xff, 0xff, 0xff, 0xff, 0x1f];
        assert!(matches!(
            ByteReader::new(&over32).varuint32("o"),
            Err(ReadError::VarintOverflow { bits: 32, .. })
        ));
        let endless = [0x80; 6];
        assert!(matches!(
            ByteReader::new(&endless).varuint32("e"),
            Err(ReadError::VarintOverflow { .. })
        ));

        let max64 = [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01];
        assert_eq!(ByteReader::new(&max64).varuint64("m").unwrap(), u64::MAX);
        let over64 = [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02];
        assert!(ByteReader::new(&over64).varuint64("o").is_err());
        assert!(matches!(
            ByteReader::new(&[0x80, 0x80]).varuint64("t"),
            Err(ReadError::Truncated { .. })
        ));
    }

    fn utf16z(text: &str) -> Vec<u8> {
        text.encode_utf16()
            .chain([0])
            .flat_map(u16::to_le_bytes)
            .collect()
    }

    #[test]
    fn utf16_strings_are_bounded_lossy_and_fully_consumed() {
        let mut data = utf16z("Grüße, 世界");
        data.extend(utf16z("abcdef"));
        data.extend([0x00, 0xd8, 0, 0]); // unpaired high surrogate
        data.extend([0x41]); // odd trailing byte, no terminator
        let mut reader = ByteReader::new(&data);
        assert_eq!(reader.utf16z(100, "a").unwrap(), "Grüße, 世界");
        assert_eq!(reader.utf16z(3, "b").unwrap(), "abc");
        assert_eq!(reader.utf16z(100, "c").unwrap(), "\u{fffd}");
        assert_eq!(
            reader.utf16z(100, "d").unwrap_err(),
            ReadError::UnterminatedString {
                field: "d",
                offset: 38
            }
        );
    }
}
