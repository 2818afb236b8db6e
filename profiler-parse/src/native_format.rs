//! The encodings a ReadyToRun image's method tables use: the NativeFormat
//! integers, sparse arrays and hashtables of crossgen2
//! (`src/coreclr/vm/nativeformatreader.h`), and the ECMA-335 compressed
//! integers and type signatures of its method signatures (ECMA-335
//! II.23.2, with the runtime's `ELEMENT_TYPE_*_ZAPSIG` additions from
//! `corcompile.h`). Every read is bounds-checked and returns `None` past
//! the bytes; loops are bounded by the bytes they consume.
//!
//! Offsets are relative to the start of the bytes given (a section of the
//! image): the formats only ever add offsets to positions inside them.

/// One sparse array block: 16 elements in a 4-level binary tree.
const BLOCK_SIZE: u32 = 16;
/// How deep a type signature may nest (a hostile one could recurse for
/// ever).
const MAX_SIGNATURE_DEPTH: u32 = 16;
/// Most generic arguments, array sizes or bounds in one signature.
const MAX_SIGNATURE_ITEMS: u32 = 64;

/// Reads NativeFormat and signature data from a section's bytes.
#[derive(Clone, Copy, Debug)]
pub struct NativeReader<'a> {
    data: &'a [u8],
}

impl<'a> NativeReader<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Self { data }
    }

    pub fn len(&self) -> usize {
        self.data.len()
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    fn byte(&self, at: usize) -> Option<u32> {
        self.data.get(at).copied().map(u32::from)
    }

    pub fn u8_at(&self, at: usize) -> Option<u32> {
        self.byte(at)
    }

    pub fn u16_at(&self, at: usize) -> Option<u32> {
        Some(self.byte(at)? | self.byte(at + 1)? << 8)
    }

    pub fn u32_at(&self, at: usize) -> Option<u32> {
        Some(self.u16_at(at)? | self.u16_at(at + 2)? << 16)
    }

    /// A NativeFormat unsigned integer at `at`: its value and the offset
    /// after it. The low bits `0`, `01`, `011`, `0111` select 1 to 4 bytes
    /// (shifted right by 1 to 4); `01111` a plain u32 after the first byte.
    pub fn decode_unsigned(&self, at: usize) -> Option<(u32, usize)> {
        let b0 = self.byte(at)?;
        if b0 & 1 == 0 {
            Some((b0 >> 1, at + 1))
        } else if b0 & 2 == 0 {
            Some((b0 >> 2 | self.byte(at + 1)? << 6, at + 2))
        } else if b0 & 4 == 0 {
            Some((
                b0 >> 3 | self.byte(at + 1)? << 5 | self.byte(at + 2)? << 13,
                at + 3,
            ))
        } else if b0 & 8 == 0 {
            Some((
                b0 >> 4
                    | self.byte(at + 1)? << 4
                    | self.byte(at + 2)? << 12
                    | self.byte(at + 3)? << 20,
                at + 4,
            ))
        } else if b0 & 16 == 0 {
            Some((self.u32_at(at + 1)?, at + 5))
        } else {
            None
        }
    }

    /// A NativeFormat signed integer at `at` (the same lengths, sign
    /// extended from the top byte).
    pub fn decode_signed(&self, at: usize) -> Option<(i32, usize)> {
        let b0 = self.byte(at)?;
        let signed = |b: u32| i32::from(b as u8 as i8);
        if b0 & 1 == 0 {
            Some((signed(b0) >> 1, at + 1))
        } else if b0 & 2 == 0 {
            Some(((b0 >> 2) as i32 | signed(self.byte(at + 1)?) << 6, at + 2))
        } else if b0 & 4 == 0 {
            Some((
                (b0 >> 3 | self.byte(at + 1)? << 5) as i32 | signed(self.byte(at + 2)?) << 13,
                at + 3,
            ))
        } else if b0 & 8 == 0 {
            Some((
                (b0 >> 4 | self.byte(at + 1)? << 4 | self.byte(at + 2)? << 12) as i32
                    | signed(self.byte(at + 3)?) << 20,
                at + 4,
            ))
        } else if b0 & 16 == 0 {
            Some((self.u32_at(at + 1)? as i32, at + 5))
        } else {
            None
        }
    }

    /// The runtime function index of a method entry point at `at`: a
    /// NativeFormat unsigned whose bit 0 says fixups follow (then bit 1
    /// says they are shared, and the index is the value >> 2), else the
    /// index is the value >> 1.
    pub fn entry_point(&self, at: usize) -> Option<u32> {
        let (id, _) = self.decode_unsigned(at)?;
        Some(if id & 1 != 0 { id >> 2 } else { id >> 1 })
    }

    /// An ECMA-335 compressed unsigned integer (II.23.2) at `at`.
    pub fn compressed(&self, at: usize) -> Option<(u32, usize)> {
        let b0 = self.byte(at)?;
        if b0 & 0x80 == 0 {
            Some((b0, at + 1))
        } else if b0 & 0xc0 == 0x80 {
            Some(((b0 & 0x3f) << 8 | self.byte(at + 1)?, at + 2))
        } else if b0 & 0xe0 == 0xc0 {
            Some((
                (b0 & 0x1f) << 24
                    | self.byte(at + 1)? << 16
                    | self.byte(at + 2)? << 8
                    | self.byte(at + 3)?,
                at + 4,
            ))
        } else {
            None
        }
    }

    /// The offset after the type signature at `at`; `None` for one this
    /// reader cannot skip (a function pointer) or a malformed one.
    pub fn skip_type(&self, at: usize) -> Option<usize> {
        self.skip_type_at_depth(at, 0)
    }

    fn skip_type_at_depth(&self, at: usize, depth: u32) -> Option<usize> {
        if depth > MAX_SIGNATURE_DEPTH {
            return None;
        }
        let next = |at| self.skip_type_at_depth(at, depth + 1);
        let element = self.byte(at)?;
        let at = at + 1;
        match element {
            // Primitive types, string, object, typedref, __Canon.
            0x01..=0x0e | 0x16 | 0x18 | 0x19 | 0x1c | 0x3e => Some(at),
            // Pointer, byref, szarray, pinned, a native value type: a type.
            0x0f | 0x10 | 0x1d | 0x45 | 0x3d => next(at),
            // Value type, class: a TypeDefOrRefOrSpec token.
            0x11 | 0x12 => Some(self.compressed(at)?.1),
            // Type and method generic parameters: a number.
            0x13 | 0x1e => Some(self.compressed(at)?.1),
            // Array: type, rank, sizes, lower bounds.
            0x14 => {
                let at = next(at)?;
                let (_rank, at) = self.compressed(at)?;
                let mut at = at;
                for _ in 0..2 {
                    let (count, after) = self.compressed(at)?;
                    if count > MAX_SIGNATURE_ITEMS {
                        return None;
                    }
                    at = after;
                    for _ in 0..count {
                        at = self.compressed(at)?.1;
                    }
                }
                Some(at)
            }
            // Generic instantiation: the generic type, then its arguments.
            0x15 => {
                let mut at = next(at)?;
                let (count, after) = self.compressed(at)?;
                if count > MAX_SIGNATURE_ITEMS {
                    return None;
                }
                at = after;
                for _ in 0..count {
                    at = next(at)?;
                }
                Some(at)
            }
            // Custom modifiers: a token, then the type.
            0x1f | 0x20 => next(self.compressed(at)?.1),
            // A type from another module of the version bubble: its index,
            // then the type.
            0x3f => next(self.compressed(at)?.1),
            _ => None,
        }
    }
}

/// A NativeFormat sparse array (`NativeArray`): element `i`'s offset.
#[derive(Clone, Copy, Debug)]
pub struct NativeArray<'a> {
    reader: NativeReader<'a>,
    base: usize,
    elements: u32,
    entry_index_size: u32,
}

impl<'a> NativeArray<'a> {
    /// The array whose header is at `at`.
    pub fn new(reader: NativeReader<'a>, at: usize) -> Option<Self> {
        let (header, base) = reader.decode_unsigned(at)?;
        Some(Self {
            reader,
            base,
            elements: header >> 2,
            entry_index_size: header & 3,
        })
    }

    pub fn len(&self) -> u32 {
        self.elements
    }

    pub fn is_empty(&self) -> bool {
        self.elements == 0
    }

    /// The offset of element `index`, `None` when the array does not hold
    /// it.
    pub fn get(&self, index: u32) -> Option<usize> {
        if index >= self.elements {
            return None;
        }
        let block = (index / BLOCK_SIZE) as usize;
        let block_offset = match self.entry_index_size {
            0 => self.reader.u8_at(self.base + block)?,
            1 => self.reader.u16_at(self.base + 2 * block)?,
            _ => self.reader.u32_at(self.base + 4 * block)?,
        };
        let mut offset = self.base.checked_add(block_offset as usize)?;
        let mut bit = BLOCK_SIZE >> 1;
        while bit > 0 {
            let (value, after) = self.reader.decode_unsigned(offset)?;
            if index & bit != 0 {
                if value & 2 != 0 {
                    offset = offset.checked_add((value >> 2) as usize)?;
                    bit >>= 1;
                    continue;
                }
            } else if value & 1 != 0 {
                offset = after;
                bit >>= 1;
                continue;
            }
            // A leaf for one element of the subtree.
            if value & 3 == 0 && value >> 2 == index & (BLOCK_SIZE - 1) {
                return Some(after);
            }
            return None;
        }
        Some(offset)
    }
}

/// Every entry of a NativeFormat hashtable (`NativeHashtable`): the
/// offsets where their data starts.
pub fn hashtable_entries(reader: NativeReader<'_>, at: usize, max: usize) -> Option<Vec<usize>> {
    let header = reader.u8_at(at)?;
    let base = at + 1;
    let bucket_shift = header >> 2;
    if bucket_shift > 24 {
        return None;
    }
    let buckets = 1usize << bucket_shift;
    let entry_index_size = header & 3;
    let bucket_bounds = |bucket: usize| -> Option<(usize, usize)> {
        let (start, end) = match entry_index_size {
            0 => (
                reader.u8_at(base + bucket)?,
                reader.u8_at(base + bucket + 1)?,
            ),
            1 => (
                reader.u16_at(base + 2 * bucket)?,
                reader.u16_at(base + 2 * bucket + 2)?,
            ),
            _ => (
                reader.u32_at(base + 4 * bucket)?,
                reader.u32_at(base + 4 * bucket + 4)?,
            ),
        };
        Some((base + start as usize, base + end as usize))
    };
    let mut entries = Vec::new();
    for bucket in 0..buckets {
        let (mut at, end) = bucket_bounds(bucket)?;
        if end > reader.len() {
            return None;
        }
        // Each entry: the low byte of its hash, then a signed offset from
        // the offset's own position to the entry's data.
        while at < end {
            let (delta, after) = reader.decode_signed(at + 1)?;
            let entry = (at + 1).checked_add_signed(delta as isize)?;
            if entries.len() >= max {
                return Some(entries);
            }
            entries.push(entry);
            at = after;
        }
    }
    Some(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn native_integers() {
        let r = NativeReader::new(&[0x04, 0x05, 0x02, 0x0b, 0x00, 0x01, 0x0f, 1, 2, 3, 4]);
        assert_eq!(r.decode_unsigned(0), Some((2, 1)));
        // 0x05 = 0b101: two bytes, (0x05 >> 2) | 0x02 << 6.
        assert_eq!(r.decode_unsigned(1), Some((1 | 0x02 << 6, 3)));
        // 0x0b = 0b1011: three bytes.
        assert_eq!(r.decode_unsigned(3), Some((1 | 1 << 13, 6)));
        assert_eq!(r.decode_unsigned(6), Some((0x0403_0201, 11)));
        assert_eq!(r.decode_unsigned(11), None);
        assert_eq!(
            NativeReader::new(&[0x1f, 0, 0, 0, 0]).decode_unsigned(0),
            None
        );
        let s = NativeReader::new(&[0xfe, 0x7e, 0x01, 0xff]);
        assert_eq!(s.decode_signed(0), Some((-1, 1)));
        assert_eq!(s.decode_signed(1), Some((63, 2)));
        assert_eq!(s.decode_signed(2), Some((-64, 4)));
    }

    #[test]
    fn compressed_integers_and_types() {
        let r = NativeReader::new(&[0x03, 0x80, 0x80, 0xc0, 0, 0x40, 0]);
        assert_eq!(r.compressed(0), Some((3, 1)));
        assert_eq!(r.compressed(1), Some((0x80, 3)));
        assert_eq!(r.compressed(3), Some((0x4000, 7)));
        // GENERICINST CLASS token 2 args: I4, SZARRAY STRING.
        let sig = NativeReader::new(&[0x15, 0x12, 0x09, 0x02, 0x08, 0x1d, 0x0e, 0xff]);
        assert_eq!(sig.skip_type(0), Some(7));
        // Function pointers and unknown elements are not skipped.
        assert_eq!(NativeReader::new(&[0x1b, 0]).skip_type(0), None);
        // Endless nesting ends.
        assert_eq!(NativeReader::new(&[0x0f; 64]).skip_type(0), None);
    }

    /// A sparse array as crossgen2's `VertexArray` writes one block of 3
    /// elements (0, 1 and 5): each tree node says which children exist.
    #[test]
    fn sparse_array_elements() {
        // Header: 6 elements, 1-byte block offsets; one block at +1.
        // Tree for index bits 8, 4, 2, 1 (MSB first). Elements 0,1 under
        // bit8=0,bit4=0,bit2=0; element 5 under bit4=1. Built by hand with
        // leaves: a leaf node (value & 3 == 0) names the one element of its
        // subtree.
        let mut bytes: Vec<u8> = vec![(6 << 2) << 1];
        bytes.push(1); // block 0 at base + 1
        // bit 8: only the 0 side -> value 1 (has left child, no right).
        bytes.push(1 << 1);
        // bit 4: both sides: value = right offset << 2 | 3.
        let bit4_at = bytes.len();
        bytes.push(0);
        // left side (elements 0..3), bit 2: left only.
        bytes.push(1 << 1);
        // bit 1: both: element 0 after it, element 1 at +2.
        bytes.push(((2 << 2) | 3) << 1);
        bytes.push(10 << 1); // element 0's value
        bytes.push(11 << 1); // element 1's value
        let right = bytes.len();
        bytes[bit4_at] = ((((right - bit4_at) << 2) | 3) << 1) as u8;
        // Right side (elements 4..7): a leaf for element 5.
        bytes.push(((5 << 2) << 1) as u8);
        bytes.push(15 << 1); // element 5's value
        let reader = NativeReader::new(&bytes);
        let array = NativeArray::new(reader, 0).expect("header");
        assert_eq!(array.len(), 6);
        let value = |i| {
            array
                .get(i)
                .and_then(|at| reader.decode_unsigned(at))
                .map(|v| v.0)
        };
        assert_eq!(value(0), Some(10));
        assert_eq!(value(1), Some(11));
        assert_eq!(value(5), Some(15));
        assert_eq!(value(4), None);
        assert_eq!(value(2), None);
        assert_eq!(value(6), None);
    }

    #[test]
    fn hashtable_entries_of_two_buckets() {
        // Header: 2 buckets (shift 1), 1-byte bucket offsets; bucket 0 has
        // one entry, bucket 1 none.
        let bytes = [
            1 << 2, // header
            3,      // bucket 0 starts at base + 3
            5,      // bucket 1 at base + 5 (the end of bucket 0)
            5,      // end of bucket 1
            0xaa,   // entry: low hash
            3 << 1, // the entry's data: 3 bytes on from here
            0,
            0,
            0x42, // the entry's data
        ];
        let reader = NativeReader::new(&bytes);
        assert_eq!(hashtable_entries(reader, 0, 10), Some(vec![8]));
        assert_eq!(hashtable_entries(reader, 0, 0), Some(vec![]));
        assert_eq!(
            hashtable_entries(NativeReader::new(&bytes[..2]), 0, 10),
            None
        );
    }
}
