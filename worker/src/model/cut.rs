//! Changed copies of a GGUF model: metadata edited, tensors dropped, the data of the rest
//! copied as stored. A copy cut to its first layers keeps the vocabulary, embeddings and output
//! head with fewer blocks: a cheap (and poor) draft model for its own original.

use super::gguf::{Gguf, Value};
use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::Path;

/// Writes `src`'s first `layers` blocks to `dst`.
pub fn cut_layers(src: &Path, dst: &Path, layers: usize) -> Result<(), String> {
    rewrite(src, dst, |g| {
        let arch = g
            .get_str("general.architecture")
            .map_err(|e| e.to_string())?;
        let key = format!("{arch}.block_count");
        let had = g.get_u64(&key).map_err(|e| e.to_string())? as usize;
        if layers == 0 || layers > had {
            return Err(format!("cannot keep {layers} layers of {had} (1 to {had})"));
        }
        let count = match g.metadata.get(&key) {
            Some(Value::U64(_)) => Value::U64(layers as u64),
            _ => Value::U32(layers as u32),
        };
        g.metadata.insert(key, count);
        g.tensors.retain(|t| {
            t.name
                .strip_prefix("blk.")
                .and_then(|rest| rest.split('.').next())
                .and_then(|n| n.parse::<usize>().ok())
                .is_none_or(|n| n < layers)
        });
        Ok(())
    })
}

/// Writes `src` to `dst` as `edit` changes its metadata and tensor list (a tensor's data comes
/// from the tensor of the same name in `src`).
pub fn rewrite(
    src: &Path,
    dst: &Path,
    edit: impl FnOnce(&mut Gguf) -> Result<(), String>,
) -> Result<(), String> {
    let named = |e: &dyn std::fmt::Display| format!("{}: {e}", src.display());
    let mut g = Gguf::open(src).map_err(|e| named(&e))?;
    let len = std::fs::metadata(src).map_err(|e| named(&e))?.len();
    let source_data = g.data_offset;
    // Each tensor's bytes run to the next one's start (padding included), the last to the end.
    let mut starts: Vec<u64> = g.tensors.iter().map(|t| t.offset).collect();
    starts.sort_unstable();
    let extents: HashMap<String, (u64, u64)> = g
        .tensors
        .iter()
        .map(|t| {
            let next = starts.partition_point(|&s| s <= t.offset);
            let end = starts.get(next).copied().unwrap_or(len - source_data);
            (t.name.clone(), (t.offset, end - t.offset))
        })
        .collect();
    edit(&mut g).map_err(|e| named(&e))?;
    let mut copies = Vec::new();
    let mut offset = 0;
    for t in &mut g.tensors {
        let &(from, size) = extents
            .get(&t.name)
            .ok_or_else(|| named(&format!("no tensor `{}` to copy", t.name)))?;
        copies.push((from, size));
        t.offset = offset;
        offset += size;
    }
    let write_err = |e: std::io::Error| format!("{}: {e}", dst.display());
    let mut out = BufWriter::new(File::create(dst).map_err(write_err)?);
    g.write_header(&mut out).map_err(write_err)?;
    let mut input = BufReader::new(File::open(src).map_err(|e| named(&e))?);
    for (from, size) in copies {
        input
            .seek(SeekFrom::Start(source_data + from))
            .map_err(|e| named(&e))?;
        let copied = std::io::copy(&mut (&mut input).take(size), &mut out).map_err(write_err)?;
        if copied != size {
            return Err(named(&"the file ends inside a tensor"));
        }
    }
    out.flush().map_err(write_err)
}
