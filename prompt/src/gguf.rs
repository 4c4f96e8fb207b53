//! GGUF reader (versions 1-3): header, every metadata type, tensor infos, alignment.
//!
//! Reads sequentially from any `Read`, so loading metadata does not touch the tensor data.
//! Counts are u64 from version 2 on and u32 in version 1. Every length is bounded before it is
//! allocated, so a corrupt or hostile file gives an error, never an abort.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

const MAGIC: u32 = 0x4655_4747; // "GGUF" little-endian
const MAX_STRING: u64 = 64 << 20;
const MAX_ARRAY: u64 = 1 << 26;
const MAX_ENTRIES: u64 = 1 << 20;
const MAX_TENSORS: u64 = 1 << 20;
const MAX_DIMS: u32 = 4;
const MAX_NESTING: u32 = 4;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot read {path}: {source}")]
    Open {
        path: String,
        source: std::io::Error,
    },
    #[error("not a GGUF file: magic {0:#010x}, expected 0x46554747 (\"GGUF\")")]
    BadMagic(u32),
    #[error("GGUF version {0} is not supported (1 to 3 are)")]
    UnsupportedVersion(u32),
    #[error("the file is truncated: it ends inside {0}")]
    Truncated(String),
    #[error("read error in {what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error("{what} is {value}, over the limit of {limit}")]
    TooLarge {
        what: String,
        value: u64,
        limit: u64,
    },
    #[error("{0} is not valid UTF-8")]
    BadUtf8(String),
    #[error("metadata `{key}` has unknown value type {type_id}")]
    BadValueType { key: String, type_id: u32 },
    #[error("tensor `{name}`: {problem}")]
    BadTensor { name: String, problem: String },
    #[error("metadata `{0}` is missing")]
    MissingKey(String),
    #[error("metadata `{key}` is a {found}, expected {expected}")]
    WrongType {
        key: String,
        found: &'static str,
        expected: &'static str,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    fn kind(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::F32(_) => "f32",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F64(_) => "f64",
        }
    }

    /// Any integer type as u64 (negative values are not).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }
}

/// A tensor's description; its data is at `data_offset + offset` in the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions, contiguous first (a `[out, in]` weight is stored as `[in, out]`).
    pub dims: Vec<u64>,
    pub ggml_type: u32,
    pub offset: u64,
}

impl TensorInfo {
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

#[derive(Debug, Clone)]
pub struct Gguf {
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    /// File offset of the tensor data section.
    pub data_offset: u64,
}

impl Gguf {
    pub fn open(path: &Path) -> Result<Gguf, GgufError> {
        let file = std::fs::File::open(path).map_err(|source| GgufError::Open {
            path: path.display().to_string(),
            source,
        })?;
        Gguf::read(std::io::BufReader::new(file))
    }

    pub fn read(reader: impl Read) -> Result<Gguf, GgufError> {
        let mut r = Reader {
            inner: reader,
            pos: 0,
            version: 0,
        };
        let magic = r.u32("the header")?;
        if magic != MAGIC {
            return Err(GgufError::BadMagic(magic));
        }
        r.version = r.u32("the header")?;
        if !(1..=3).contains(&r.version) {
            return Err(GgufError::UnsupportedVersion(r.version));
        }
        let tensor_count = r.count("the tensor count", MAX_TENSORS)?;
        let entry_count = r.count("the metadata count", MAX_ENTRIES)?;
        let mut metadata = BTreeMap::new();
        for _ in 0..entry_count {
            let key = r.string("a metadata key")?;
            let type_id = r.u32(&format!("metadata `{key}`"))?;
            let value = r.value(&key, type_id, 0)?;
            metadata.insert(key, value);
        }
        let mut tensors = Vec::with_capacity(tensor_count.min(4096) as usize);
        for _ in 0..tensor_count {
            let name = r.string("a tensor name")?;
            let n_dims = r.u32(&format!("tensor `{name}`"))?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(GgufError::BadTensor {
                    name,
                    problem: format!("{n_dims} dimensions (1 to {MAX_DIMS} allowed)"),
                });
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(r.count(&format!("tensor `{name}` dimensions"), u64::MAX)?);
            }
            let elements = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
            if elements.is_none_or(|e| e == 0 || e > 1 << 40) {
                return Err(GgufError::BadTensor {
                    name,
                    problem: format!("absurd dimensions {dims:?}"),
                });
            }
            let ggml_type = r.u32(&format!("tensor `{name}`"))?;
            let offset = r.u64(&format!("tensor `{name}`"))?;
            tensors.push(TensorInfo {
                name,
                dims,
                ggml_type,
                offset,
            });
        }
        let alignment = match metadata.get("general.alignment").and_then(Value::as_u64) {
            Some(a) if a.is_power_of_two() && a <= 1 << 20 => a,
            Some(a) => {
                return Err(GgufError::TooLarge {
                    what: "general.alignment (a power of two)".into(),
                    value: a,
                    limit: 1 << 20,
                })
            }
            None => 32,
        };
        let data_offset = r.pos.div_ceil(alignment) * alignment;
        for t in &tensors {
            if t.offset % alignment != 0 {
                return Err(GgufError::BadTensor {
                    name: t.name.clone(),
                    problem: format!("offset {} is not aligned to {alignment}", t.offset),
                });
            }
        }
        Ok(Gguf {
            version: r.version,
            metadata,
            tensors,
            alignment,
            data_offset,
        })
    }

    pub fn get(&self, key: &str) -> Result<&Value, GgufError> {
        self.metadata
            .get(key)
            .ok_or_else(|| GgufError::MissingKey(key.to_string()))
    }

    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self.get(key)?;
        v.as_u64().ok_or_else(|| GgufError::WrongType {
            key: key.into(),
            found: v.kind(),
            expected: "an integer",
        })
    }

    pub fn get_f64(&self, key: &str) -> Result<f64, GgufError> {
        let v = self.get(key)?;
        v.as_f64().ok_or_else(|| GgufError::WrongType {
            key: key.into(),
            found: v.kind(),
            expected: "a number",
        })
    }

    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        match self.get(key)? {
            Value::String(s) => Ok(s),
            v => Err(GgufError::WrongType {
                key: key.into(),
                found: v.kind(),
                expected: "a string",
            }),
        }
    }

    pub fn get_array(&self, key: &str) -> Result<&[Value], GgufError> {
        match self.get(key)? {
            Value::Array(a) => Ok(a),
            v => Err(GgufError::WrongType {
                key: key.into(),
                found: v.kind(),
                expected: "an array",
            }),
        }
    }

    /// An array of strings.
    pub fn get_strings(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        self.get_array(key)?
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.as_str()),
                other => Err(GgufError::WrongType {
                    key: key.into(),
                    found: other.kind(),
                    expected: "an array of strings",
                }),
            })
            .collect()
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

struct Reader<R> {
    inner: R,
    pos: u64,
    version: u32,
}

impl<R: Read> Reader<R> {
    fn bytes<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let mut buf = [0u8; N];
        self.inner
            .read_exact(&mut buf)
            .map_err(|e| io_error(e, what))?;
        self.pos += N as u64;
        Ok(buf)
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.bytes(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.bytes(what)?))
    }

    /// A count or length: u32 in version 1, u64 later; bounded by `limit`.
    fn count(&mut self, what: &str, limit: u64) -> Result<u64, GgufError> {
        let n = if self.version == 1 {
            u64::from(self.u32(what)?)
        } else {
            self.u64(what)?
        };
        if n > limit {
            return Err(GgufError::TooLarge {
                what: what.to_string(),
                value: n,
                limit,
            });
        }
        Ok(n)
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let len = self.count(&format!("the length of {what}"), MAX_STRING)?;
        let mut buf = Vec::new();
        (&mut self.inner)
            .take(len)
            .read_to_end(&mut buf)
            .map_err(|e| io_error(e, what))?;
        if buf.len() as u64 != len {
            return Err(GgufError::Truncated(what.to_string()));
        }
        self.pos += len;
        String::from_utf8(buf).map_err(|_| GgufError::BadUtf8(what.to_string()))
    }

    fn value(&mut self, key: &str, type_id: u32, depth: u32) -> Result<Value, GgufError> {
        let what = format!("metadata `{key}`");
        Ok(match type_id {
            0 => Value::U8(u8::from_le_bytes(self.bytes(&what)?)),
            1 => Value::I8(i8::from_le_bytes(self.bytes(&what)?)),
            2 => Value::U16(u16::from_le_bytes(self.bytes(&what)?)),
            3 => Value::I16(i16::from_le_bytes(self.bytes(&what)?)),
            4 => Value::U32(u32::from_le_bytes(self.bytes(&what)?)),
            5 => Value::I32(i32::from_le_bytes(self.bytes(&what)?)),
            6 => Value::F32(f32::from_le_bytes(self.bytes(&what)?)),
            7 => Value::Bool(self.bytes::<1>(&what)?[0] != 0),
            8 => Value::String(self.string(&what)?),
            9 => {
                if depth >= MAX_NESTING {
                    return Err(GgufError::TooLarge {
                        what: format!("nesting of {what}"),
                        value: depth.into(),
                        limit: MAX_NESTING.into(),
                    });
                }
                let element_type = self.u32(&what)?;
                let n = self.count(&format!("the length of {what}"), MAX_ARRAY)?;
                let mut items = Vec::with_capacity(n.min(1 << 16) as usize);
                for _ in 0..n {
                    items.push(self.value(key, element_type, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(u64::from_le_bytes(self.bytes(&what)?)),
            11 => Value::I64(i64::from_le_bytes(self.bytes(&what)?)),
            12 => Value::F64(f64::from_le_bytes(self.bytes(&what)?)),
            other => {
                return Err(GgufError::BadValueType {
                    key: key.to_string(),
                    type_id: other,
                })
            }
        })
    }
}

fn io_error(e: std::io::Error, what: &str) -> GgufError {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        GgufError::Truncated(what.to_string())
    } else {
        GgufError::Io {
            what: what.to_string(),
            source: e,
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A small valid GGUF v3 file: two metadata entries and one tensor.
    pub fn sample() -> Vec<u8> {
        let mut b = Vec::new();
        let s = |b: &mut Vec<u8>, v: &str| {
            b.extend_from_slice(&(v.len() as u64).to_le_bytes());
            b.extend_from_slice(v.as_bytes());
        };
        b.extend_from_slice(&MAGIC.to_le_bytes());
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes()); // tensors
        b.extend_from_slice(&3u64.to_le_bytes()); // metadata
        s(&mut b, "general.architecture");
        b.extend_from_slice(&8u32.to_le_bytes());
        s(&mut b, "llama");
        s(&mut b, "llama.block_count");
        b.extend_from_slice(&4u32.to_le_bytes());
        b.extend_from_slice(&30u32.to_le_bytes());
        s(&mut b, "tokenizer.ggml.tokens");
        b.extend_from_slice(&9u32.to_le_bytes());
        b.extend_from_slice(&8u32.to_le_bytes());
        b.extend_from_slice(&2u64.to_le_bytes());
        s(&mut b, "a");
        s(&mut b, "b");
        s(&mut b, "token_embd.weight");
        b.extend_from_slice(&2u32.to_le_bytes());
        b.extend_from_slice(&64u64.to_le_bytes());
        b.extend_from_slice(&10u64.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        b
    }

    #[test]
    fn reads_a_valid_file() {
        let g = Gguf::read(&sample()[..]).unwrap();
        assert_eq!(g.get_str("general.architecture").unwrap(), "llama");
        assert_eq!(g.get_u64("llama.block_count").unwrap(), 30);
        assert_eq!(
            g.get_strings("tokenizer.ggml.tokens").unwrap(),
            vec!["a", "b"]
        );
        assert_eq!(g.tensors[0].dims, vec![64, 10]);
        assert_eq!(g.data_offset % 32, 0);
        assert!(matches!(
            g.get_u64("general.architecture"),
            Err(GgufError::WrongType { .. })
        ));
        assert!(matches!(g.get("nope"), Err(GgufError::MissingKey(_))));
    }

    #[test]
    fn clear_errors_for_bad_files() {
        let mut bad = sample();
        bad[0] = b'X';
        assert!(matches!(Gguf::read(&bad[..]), Err(GgufError::BadMagic(_))));
        let mut v9 = sample();
        v9[4] = 9;
        assert!(matches!(
            Gguf::read(&v9[..]),
            Err(GgufError::UnsupportedVersion(9))
        ));
        let mut huge = sample();
        huge[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            Gguf::read(&huge[..]),
            Err(GgufError::TooLarge { .. })
        ));
        let full = sample();
        for cut in [3, 10, 30, 60, full.len() - 1] {
            let e = Gguf::read(&full[..cut]).unwrap_err();
            assert!(matches!(e, GgufError::Truncated(_)), "cut at {cut}: {e}");
        }
    }

    proptest! {
        /// Any corruption gives an error or a file, never a panic or a huge allocation.
        #[test]
        fn corrupt_files_never_panic(flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8), cut in any::<prop::sample::Index>()) {
            let mut bytes = sample();
            for (i, v) in flips {
                let i = i.index(bytes.len());
                bytes[i] = v;
            }
            let end = cut.index(bytes.len() + 1);
            let _ = Gguf::read(&bytes[..end]);
        }
    }
}
