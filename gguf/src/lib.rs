//! A GGUF v3 reader: metadata, tensor directory, and dequantisation of Q4_1, Q8_0, F16 and F32
//! tensors to f32.
//!
//! Layout (ggml's gguf.md): magic `GGUF`, version u32, tensor count u64, metadata count u64;
//! metadata key/values; tensor infos (name, dims `ne[0..n]`, type, offset); padding to
//! `general.alignment` (default 32); tensor data. `ne[0]` is the fastest-varying dimension, so a
//! 2-D weight is `[ne[1], ne[0]]` = `[out, in]` in row-major terms, like a PyTorch Linear weight.

use std::collections::HashMap;
use std::path::Path;

/// Why a GGUF file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The bytes are not a GGUF v3 file, or are cut short.
    #[error("malformed GGUF: {0}")]
    Malformed(String),
    /// A metadata key the model needs is missing or has the wrong type.
    #[error("GGUF metadata `{0}` is missing or has an unexpected type")]
    Metadata(String),
    /// A tensor the model needs is missing.
    #[error("GGUF tensor `{0}` is missing")]
    MissingTensor(String),
    /// A tensor uses a quantisation this reader does not implement.
    #[error("tensor `{name}` uses ggml type {kind} ({label}); supported: F32, F16, Q4_1, Q8_0")]
    UnsupportedType {
        /// The tensor.
        name: String,
        /// ggml type id.
        kind: u32,
        /// Its name, when known.
        label: &'static str,
    },
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// Any unsigned integer type.
    U64(u64),
    /// Any signed integer type.
    I64(i64),
    /// f32 or f64.
    F64(f64),
    /// bool.
    Bool(bool),
    /// UTF-8 string.
    Str(String),
    /// An array of values.
    Array(Vec<Value>),
}

impl Value {
    /// As an unsigned integer.
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            Value::U64(v) => Some(*v),
            Value::I64(v) => u64::try_from(*v).ok(),
            _ => None,
        }
    }
    /// As a float.
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::F64(v) => Some(*v),
            _ => None,
        }
    }
    /// As a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    /// As an array.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// The largest `general.alignment` accepted (ggml writes 32).
const MAX_ALIGNMENT: u64 = 1 << 20;
/// The fewest bytes a tensor's directory entry takes (name length, dims count, type, offset).
const MIN_TENSOR_INFO: usize = 8 + 4 + 4 + 8;
/// The most array elements reserved ahead of reading them (a hint, not a bound).
const MAX_ARRAY_RESERVE: usize = 1 << 16;
/// The most metadata array elements a file may hold, all arrays together. An element takes a
/// byte of the file and ~32 in memory, so the file's size alone bounded memory only at 32-64x
/// its size; real models hold under a million (vocabulary, scores, token types, merges).
pub const MAX_METADATA_ELEMENTS: usize = 1 << 22;

/// ggml tensor types this reader knows by name.
const F32: u32 = 0;
const F16: u32 = 1;
const Q4_1: u32 = 3;
const Q8_0: u32 = 8;

fn type_label(t: u32) -> &'static str {
    match t {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        6 => "Q5_0",
        7 => "Q5_1",
        8 => "Q8_0",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        15 => "Q8_K",
        30 => "BF16",
        _ => "unknown",
    }
}

/// One tensor's directory entry.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    /// ggml dims, `ne[0]` first.
    pub dims: Vec<u64>,
    /// ggml type id.
    pub kind: u32,
    /// Absolute byte offset of its data in the file.
    pub start: usize,
}

impl TensorInfo {
    /// Number of elements (saturating: [`Gguf::parse`] refuses tensors whose count overflows,
    /// so only a hand-built entry can reach the bound).
    pub fn elements(&self) -> usize {
        element_count(&self.dims).unwrap_or(usize::MAX)
    }

    /// Row-major shape: dims reversed (`[out, in]` for a weight).
    pub fn shape(&self) -> Vec<i64> {
        self.dims.iter().rev().map(|&d| d as i64).collect()
    }
}

/// A parsed GGUF file, held in memory.
pub struct Gguf {
    data: Vec<u8>,
    /// Metadata by key.
    pub metadata: HashMap<String, Value>,
    /// Tensors by name.
    pub tensors: HashMap<String, TensorInfo>,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    /// Metadata array elements still allowed ([`MAX_METADATA_ELEMENTS`]).
    elements_left: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], GgufError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| GgufError::Malformed(format!("truncated at byte {}", self.pos)))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, GgufError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, GgufError> {
        Ok(u16::from_le_bytes([self.u8()?, self.u8()?]))
    }
    fn u32(&mut self) -> Result<u32, GgufError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, GgufError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn len(&mut self) -> Result<usize, GgufError> {
        let n = self.u64()?;
        // Nothing in a file can be longer than the file.
        usize::try_from(n)
            .ok()
            .filter(|&n| n <= self.buf.len())
            .ok_or_else(|| GgufError::Malformed(format!("length {n} at byte {}", self.pos)))
    }
    fn string(&mut self) -> Result<String, GgufError> {
        let n = self.len()?;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec())
            .map_err(|_| GgufError::Malformed(format!("non-UTF-8 string at byte {}", self.pos)))
    }
    fn value(&mut self, kind: u32, depth: u32) -> Result<Value, GgufError> {
        Ok(match kind {
            0 => Value::U64(self.u8()? as u64),
            1 => Value::I64(self.u8()? as i8 as i64),
            2 => Value::U64(self.u16()? as u64),
            3 => Value::I64(self.u16()? as i16 as i64),
            4 => Value::U64(self.u32()? as u64),
            5 => Value::I64(self.u32()? as i32 as i64),
            6 => Value::F64(f32::from_bits(self.u32()?) as f64),
            7 => Value::Bool(self.u8()? != 0),
            8 => Value::Str(self.string()?),
            9 if depth < 2 => {
                let inner = self.u32()?;
                let n = self.len()?;
                self.elements_left = self.elements_left.checked_sub(n).ok_or_else(|| {
                    GgufError::Malformed(format!(
                        "more than {MAX_METADATA_ELEMENTS} metadata array elements"
                    ))
                })?;
                // Every element takes a byte or more of the file; the reserve is capped too, as an
                // element costs far more in memory than in the file.
                let mut v =
                    Vec::with_capacity(n.min(self.buf.len() - self.pos).min(MAX_ARRAY_RESERVE));
                for _ in 0..n {
                    v.push(self.value(inner, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(self.u64()? as i64),
            12 => Value::F64(f64::from_bits(self.u64()?)),
            other => {
                return Err(GgufError::Malformed(format!(
                    "metadata value type {other} at byte {}",
                    self.pos
                )))
            }
        })
    }
}

impl Gguf {
    /// The whole file as read.
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }

    /// Reads and parses `path`.
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let data = std::fs::read(path).map_err(|source| GgufError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(data)
    }

    /// Parses a whole GGUF file.
    pub fn parse(data: Vec<u8>) -> Result<Self, GgufError> {
        let mut c = Cursor {
            buf: &data,
            pos: 0,
            elements_left: MAX_METADATA_ELEMENTS,
        };
        if c.take(4)? != b"GGUF" {
            return Err(GgufError::Malformed("not a GGUF file (bad magic)".into()));
        }
        let version = c.u32()?;
        if version != 3 {
            return Err(GgufError::Malformed(format!(
                "GGUF version {version}; only version 3 is supported"
            )));
        }
        let n_tensors = c.len()?;
        let n_kv = c.len()?;
        let mut metadata = HashMap::new();
        for _ in 0..n_kv {
            let key = c.string()?;
            let kind = c.u32()?;
            let value = c.value(kind, 0)?;
            // ggml refuses repeats; keeping either one would be a guess.
            if metadata.insert(key.clone(), value).is_some() {
                return Err(GgufError::Malformed(format!(
                    "metadata key {key} appears twice"
                )));
            }
        }
        // A count is only believed as far as the bytes left could hold its entries.
        let mut infos = Vec::with_capacity(n_tensors.min((data.len() - c.pos) / MIN_TENSOR_INFO));
        for _ in 0..n_tensors {
            let name = c.string()?;
            let n_dims = c.u32()?;
            if n_dims > 4 {
                return Err(GgufError::Malformed(format!(
                    "tensor {name} has {n_dims} dims"
                )));
            }
            let dims = (0..n_dims)
                .map(|_| c.u64())
                .collect::<Result<Vec<_>, _>>()?;
            // The shape goes to libtorch as i64, and its product may be taken in any order: the
            // product of the non-zero dims must fit (then every dim and partial product does).
            let nonzero: Vec<u64> = dims.iter().copied().filter(|&d| d != 0).collect();
            if element_count(&nonzero)
                .and_then(|n| i64::try_from(n).ok())
                .is_none()
            {
                return Err(GgufError::Malformed(format!(
                    "tensor {name}: dims {dims:?} overflow the element count"
                )));
            }
            let kind = c.u32()?;
            let offset = c.u64()?;
            infos.push((name, dims, kind, offset));
        }
        let alignment = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => v
                .as_u64()
                .filter(|&a| a > 0 && a % 8 == 0 && a <= MAX_ALIGNMENT)
                .ok_or_else(|| {
                    GgufError::Malformed(format!(
                        "general.alignment {v:?}: must be a multiple of 8 from 8 to {MAX_ALIGNMENT}"
                    ))
                })? as usize,
        };
        let base = c.pos.div_ceil(alignment) * alignment;
        let mut tensors = HashMap::new();
        for (name, dims, kind, offset) in infos {
            let start = usize::try_from(offset)
                .ok()
                .and_then(|o| base.checked_add(o))
                .ok_or_else(|| {
                    GgufError::Malformed(format!("tensor {name}: offset {offset} overflows"))
                })?;
            let info = TensorInfo { dims, kind, start };
            if let Some(bytes) = byte_len(info.kind, info.elements()) {
                if start.checked_add(bytes).is_none_or(|end| end > data.len()) {
                    return Err(GgufError::Malformed(format!(
                        "tensor {name} runs past the end of the file"
                    )));
                }
            }
            if tensors.contains_key(&name) {
                return Err(GgufError::Malformed(format!("tensor {name} appears twice")));
            }
            tensors.insert(name, info);
        }
        Ok(Gguf {
            data,
            metadata,
            tensors,
        })
    }

    /// A metadata value.
    pub fn get(&self, key: &str) -> Result<&Value, GgufError> {
        self.metadata
            .get(key)
            .ok_or_else(|| GgufError::Metadata(key.into()))
    }

    /// A metadata unsigned integer.
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        self.get(key)?
            .as_u64()
            .ok_or_else(|| GgufError::Metadata(key.into()))
    }

    /// A metadata float.
    pub fn get_f64(&self, key: &str) -> Result<f64, GgufError> {
        self.get(key)?
            .as_f64()
            .ok_or_else(|| GgufError::Metadata(key.into()))
    }

    /// A metadata string.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        self.get(key)?
            .as_str()
            .ok_or_else(|| GgufError::Metadata(key.into()))
    }

    /// A metadata array of strings.
    pub fn get_strings(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        self.get(key)?
            .as_array()
            .and_then(|a| a.iter().map(Value::as_str).collect())
            .ok_or_else(|| GgufError::Metadata(key.into()))
    }

    /// The tensor `name` dequantised to f32, with its row-major shape.
    pub fn dequantize(&self, name: &str) -> Result<(Vec<f32>, Vec<i64>), GgufError> {
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| GgufError::MissingTensor(name.into()))?;
        let n = info.elements();
        let unsupported = || GgufError::UnsupportedType {
            name: name.into(),
            kind: info.kind,
            label: type_label(info.kind),
        };
        let bytes = byte_len(info.kind, n).ok_or_else(unsupported)?;
        // parse() checked that every tensor of a supported type lies inside the file.
        let raw = info
            .start
            .checked_add(bytes)
            .and_then(|end| self.data.get(info.start..end))
            .ok_or_else(|| GgufError::Malformed(format!("tensor {name} runs past the end")))?;
        let out = match info.kind {
            F32 => raw
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            F16 => raw
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Q4_1 => dequant_q4_1(raw),
            Q8_0 => dequant_q8_0(raw),
            _ => return Err(unsupported()),
        };
        Ok((out, info.shape()))
    }
}

/// Bytes of `n` elements of ggml type `kind`, for the supported types (`None` also when the
/// size overflows).
fn byte_len(kind: u32, n: usize) -> Option<usize> {
    match kind {
        F32 => n.checked_mul(4),
        F16 => n.checked_mul(2),
        Q4_1 => n
            .is_multiple_of(32)
            .then_some(n / 32)
            .and_then(|b| b.checked_mul(20)),
        Q8_0 => n
            .is_multiple_of(32)
            .then_some(n / 32)
            .and_then(|b| b.checked_mul(34)),
        _ => None,
    }
}

/// The product of `dims`, `None` when it overflows.
fn element_count(dims: &[u64]) -> Option<usize> {
    dims.iter()
        .try_fold(1usize, |n, &d| n.checked_mul(usize::try_from(d).ok()?))
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    half::f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Q4_1: 20-byte blocks of 32 weights: f16 scale d, f16 min m, 16 bytes of nibbles;
/// `w[j] = (q[j] & 0xF) * d + m`, `w[j + 16] = (q[j] >> 4) * d + m`.
pub fn dequant_q4_1(raw: &[u8]) -> Vec<f32> {
    let mut out = Vec::with_capacity(raw.len() / 20 * 32);
    for b in raw.chunks_exact(20) {
        let (d, m) = (f16_at(b, 0), f16_at(b, 2));
        let qs = &b[4..20];
        out.extend(qs.iter().map(|q| (q & 0xF) as f32 * d + m));
        out.extend(qs.iter().map(|q| (q >> 4) as f32 * d + m));
    }
    out
}

/// Q8_0: 34-byte blocks: f16 scale d, 32 signed bytes; `w = q * d`.
pub fn dequant_q8_0(raw: &[u8]) -> Vec<f32> {
    let mut out = Vec::with_capacity(raw.len() / 34 * 32);
    for b in raw.chunks_exact(34) {
        let d = f16_at(b, 0);
        out.extend(b[2..34].iter().map(|&q| q as i8 as f32 * d));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quant_blocks_decode_as_ggml_defines_them() {
        // Q4_1 block: d = 0.5, m = -1.0, nibbles 0..15 low and 15..0 high.
        let mut b = Vec::new();
        b.extend_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
        b.extend_from_slice(&half::f16::from_f32(-1.0).to_le_bytes());
        for j in 0..16u8 {
            b.push(j | ((15 - j) << 4));
        }
        let w = dequant_q4_1(&b);
        assert_eq!(w.len(), 32);
        assert_eq!((w[0], w[15], w[16], w[31]), (-1.0, 6.5, 6.5, -1.0));
        let mut q = half::f16::from_f32(0.25).to_le_bytes().to_vec();
        q.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let w = dequant_q8_0(&q);
        assert_eq!((w[0], w[16], w[31]), (-4.0, 0.0, 3.75));
    }

    #[test]
    fn malformed_files_are_refused_with_a_reason() {
        assert!(
            matches!(Gguf::parse(b"GGML....".to_vec()), Err(GgufError::Malformed(m)) if m.contains("magic"))
        );
        let mut v2 = b"GGUF".to_vec();
        v2.extend_from_slice(&2u32.to_le_bytes());
        assert!(matches!(Gguf::parse(v2), Err(GgufError::Malformed(m)) if m.contains("version 2")));
        let mut cut = b"GGUF".to_vec();
        cut.extend_from_slice(&3u32.to_le_bytes());
        cut.extend_from_slice(&1u64.to_le_bytes());
        assert!(
            matches!(Gguf::parse(cut), Err(GgufError::Malformed(m)) if m.contains("truncated"))
        );
    }

    /// A file with one tensor entry `w` (`dims`, type F32, `offset`) and the metadata `kv`.
    fn one_tensor(kv: &[u8], n_kv: u64, dims: &[u64], offset: u64) -> Vec<u8> {
        let mut f = b"GGUF".to_vec();
        f.extend_from_slice(&3u32.to_le_bytes());
        f.extend_from_slice(&1u64.to_le_bytes());
        f.extend_from_slice(&n_kv.to_le_bytes());
        f.extend_from_slice(kv);
        f.extend_from_slice(&1u64.to_le_bytes());
        f.push(b'w');
        f.extend_from_slice(&(dims.len() as u32).to_le_bytes());
        for d in dims {
            f.extend_from_slice(&d.to_le_bytes());
        }
        f.extend_from_slice(&F32.to_le_bytes());
        f.extend_from_slice(&offset.to_le_bytes());
        f.resize(f.len().div_ceil(32) * 32 + 16, 0);
        f
    }

    /// Fuzzing regressions (gguf): dims whose product overflows, an offset that overflows the
    /// data's base, and an alignment of 0 or 2^63 panicked on arithmetic overflow; each is now a
    /// refusal that says what was wrong, as is a repeated key. The same file with sane values
    /// parses.
    #[test]
    fn overflowing_dims_offsets_and_alignments_are_refused() {
        let ok = Gguf::parse(one_tensor(&[], 0, &[4], 0)).expect("sane file");
        assert_eq!(ok.dequantize("w").expect("w").0.len(), 4);
        let err = |f: Vec<u8>| match Gguf::parse(f) {
            Err(GgufError::Malformed(m)) => m,
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("accepted"),
        };
        assert!(err(one_tensor(&[], 0, &[1 << 32, 1 << 32], 0)).contains("overflow"));
        assert!(err(one_tensor(&[], 0, &[0, u64::MAX], 0)).contains("overflow"));
        // Zero elements, but the reversed shape's product overflows before it reaches the 0.
        assert!(err(one_tensor(&[], 0, &[0, 1 << 40, 1 << 40], 0)).contains("overflow"));
        assert!(err(one_tensor(&[], 0, &[4], u64::MAX)).contains("offset"));
        for align in [0u64, 12, 1 << 63] {
            let mut kv = Vec::new();
            kv.extend_from_slice(&17u64.to_le_bytes());
            kv.extend_from_slice(b"general.alignment");
            kv.extend_from_slice(&10u32.to_le_bytes()); // u64
            kv.extend_from_slice(&align.to_le_bytes());
            assert!(
                err(one_tensor(&kv, 1, &[4], 0)).contains("alignment"),
                "{align}"
            );
        }
        // A key given twice is refused (ggml does), not silently replaced.
        let mut kv = Vec::new();
        for _ in 0..2 {
            kv.extend_from_slice(&12u64.to_le_bytes());
            kv.extend_from_slice(b"general.name");
            kv.extend_from_slice(&8u32.to_le_bytes()); // string
            kv.extend_from_slice(&1u64.to_le_bytes());
            kv.push(b'x');
        }
        assert!(err(one_tensor(&kv, 2, &[4], 0)).contains("twice"));
    }

    /// Metadata arrays are bounded all together: two arrays of u8 that each fit but together
    /// pass [`MAX_METADATA_ELEMENTS`] are refused (an element costs ~32 bytes of memory for
    /// one of the file), the same arrays one element shorter parse.
    #[test]
    fn metadata_arrays_are_bounded_in_elements_all_together() {
        let arrays = |first: usize, second: usize| {
            let mut kv = Vec::new();
            for (key, n) in [(b"a.one", first), (b"a.two", second)] {
                kv.extend_from_slice(&5u64.to_le_bytes());
                kv.extend_from_slice(key);
                kv.extend_from_slice(&9u32.to_le_bytes()); // array
                kv.extend_from_slice(&0u32.to_le_bytes()); // of u8
                kv.extend_from_slice(&(n as u64).to_le_bytes());
                kv.resize(kv.len() + n, 7);
            }
            one_tensor(&kv, 2, &[4], 0)
        };
        let half = MAX_METADATA_ELEMENTS / 2;
        let ok = Gguf::parse(arrays(half, half)).expect("at the bound");
        assert!(matches!(ok.metadata.get("a.two"), Some(Value::Array(v)) if v.len() == half));
        match Gguf::parse(arrays(half, half + 1)) {
            Err(GgufError::Malformed(m)) => assert!(m.contains("metadata array elements"), "{m}"),
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("past the bound, accepted"),
        }
    }
}
