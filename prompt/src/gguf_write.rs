//! GGUF writer (version 3): the header, metadata and tensor infos of a [`Gguf`], so that a
//! tool can write a changed copy of a model (the tensor data is the caller's to copy).

use crate::gguf::{Gguf, Value};
use std::io::{self, Write};

impl Gguf {
    /// Writes the header, metadata and tensor infos, then zeros up to the data section
    /// (`alignment`); returns the bytes written, so the tensor data starts there.
    pub fn write_header(&self, w: &mut impl Write) -> io::Result<u64> {
        let mut out = Counted {
            inner: w,
            written: 0,
        };
        out.put(b"GGUF")?;
        out.put(&3u32.to_le_bytes())?;
        out.put(&(self.tensors.len() as u64).to_le_bytes())?;
        out.put(&(self.metadata.len() as u64).to_le_bytes())?;
        for (key, value) in &self.metadata {
            out.string(key)?;
            out.put(&type_id(value).to_le_bytes())?;
            out.value(value)?;
        }
        for t in &self.tensors {
            out.string(&t.name)?;
            out.put(&(t.dims.len() as u32).to_le_bytes())?;
            for d in &t.dims {
                out.put(&d.to_le_bytes())?;
            }
            out.put(&t.ggml_type.to_le_bytes())?;
            out.put(&t.offset.to_le_bytes())?;
        }
        let padding = out.written.next_multiple_of(self.alignment) - out.written;
        out.put(&vec![0; padding as usize])?;
        Ok(out.written)
    }
}

fn type_id(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

struct Counted<'a, W: Write> {
    inner: &'a mut W,
    written: u64,
}

impl<W: Write> Counted<'_, W> {
    fn put(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.inner.write_all(bytes)?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    fn string(&mut self, s: &str) -> io::Result<()> {
        self.put(&(s.len() as u64).to_le_bytes())?;
        self.put(s.as_bytes())
    }

    fn value(&mut self, v: &Value) -> io::Result<()> {
        match v {
            Value::U8(x) => self.put(&x.to_le_bytes()),
            Value::I8(x) => self.put(&x.to_le_bytes()),
            Value::U16(x) => self.put(&x.to_le_bytes()),
            Value::I16(x) => self.put(&x.to_le_bytes()),
            Value::U32(x) => self.put(&x.to_le_bytes()),
            Value::I32(x) => self.put(&x.to_le_bytes()),
            Value::F32(x) => self.put(&x.to_le_bytes()),
            Value::Bool(x) => self.put(&[u8::from(*x)]),
            Value::String(s) => self.string(s),
            Value::U64(x) => self.put(&x.to_le_bytes()),
            Value::I64(x) => self.put(&x.to_le_bytes()),
            Value::F64(x) => self.put(&x.to_le_bytes()),
            Value::Array(items) => {
                // An empty array's element type is lost on reading; any type reads back empty.
                let element = items.first().map_or(0, type_id);
                self.put(&element.to_le_bytes())?;
                self.put(&(items.len() as u64).to_le_bytes())?;
                items.iter().try_for_each(|item| self.value(item))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::gguf::tests::sample;
    use crate::gguf::{Gguf, Value};

    #[test]
    fn a_written_header_reads_back_the_same() {
        let mut g = Gguf::read(&sample()[..]).unwrap();
        g.metadata.insert(
            "nested".into(),
            Value::Array(vec![Value::Array(vec![Value::F64(1.5), Value::F64(-2.0)])]),
        );
        g.metadata.insert("flag".into(), Value::Bool(true));
        g.metadata.insert("small".into(), Value::I8(-3));
        let mut bytes = Vec::new();
        let written = g.write_header(&mut bytes).unwrap();
        assert_eq!(written, bytes.len() as u64);
        let back = Gguf::read(&bytes[..]).unwrap();
        assert_eq!(back.metadata, g.metadata);
        assert_eq!(back.tensors, g.tensors);
        assert_eq!(back.data_offset, written);
    }
}
