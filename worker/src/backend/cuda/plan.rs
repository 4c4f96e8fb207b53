//! A step's host-side plan for the device: per token its id, position, KV slot, what it
//! attends over and in which summation order, its RoPE angles; the block tables; the rows
//! that need logits. Everything the kernels read goes up as one array of 32-bit words in one
//! copy. Pure: unit-tested without a device.

use crate::backend::cpu::attention::SumOrder;
use crate::backend::BatchSlice;

/// RoPE's shape: the angles of pair `i` at position `pos` are `pos * theta_scale^i`,
/// multiplied up pair by pair as llama.cpp's angle cache (and the CPU backend) does.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rope {
    pub head_dim: usize,
    pub theta_scale: f32,
}

/// Where each of the plan's arrays starts in [`StepPlan::packed`], and its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Layout {
    pub tokens: usize,
    pub positions: usize,
    pub slots: usize,
    pub table_start: usize,
    pub visible: usize,
    pub sample_rows: usize,
    /// Per token: 0 for a prompt's summation order, 1 for a single token's.
    pub order: usize,
    /// Per token: `head_dim / 2` pairs (cos, sin) as f32 bits.
    pub rope: usize,
    pub tables: usize,
    /// The most positions any token attends over.
    pub max_visible: usize,
    /// Tokens in the step.
    pub num_tokens: usize,
    /// Rows that need logits.
    pub num_samples: usize,
    pub len: usize,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepPlan {
    pub packed: Vec<i32>,
    pub layout: Layout,
    /// (slice index, token row) of each row that needs logits, in batch order (padding's
    /// rows, after them, are not listed).
    pub sample_rows: Vec<(usize, usize)>,
    /// Every slice one token that samples, none drafted: a decode step, whose shape a CUDA
    /// graph can replay.
    pub decode_only: bool,
}

/// What decides whether a step can replay a CUDA graph, known from the batch before it is
/// planned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepShape {
    pub num_tokens: usize,
    /// The most positions any token attends over.
    pub max_visible: usize,
    /// Every slice one token that samples, none drafted.
    pub decode_only: bool,
}

impl StepShape {
    pub fn of(batch: &[BatchSlice<'_>], block_size: usize) -> StepShape {
        // A token sees its own and the earlier positions its table reaches.
        let visible = |s: &BatchSlice<'_>| (s.start + s.len).min(s.block_table.len() * block_size);
        StepShape {
            num_tokens: batch.iter().map(|s| s.len).sum(),
            max_visible: batch
                .iter()
                .filter(|s| s.len > 0)
                .map(visible)
                .max()
                .unwrap_or(0),
            decode_only: !batch.is_empty()
                && batch
                    .iter()
                    .all(|s| s.len == 1 && s.samples && s.draft == 0),
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlanError {
    #[error(
        "a step of {0} tokens, positions or table entries does not fit the device's 32-bit indices"
    )]
    TooLarge(usize),
}

impl StepPlan {
    /// Plans `batch` for a cache of `block_size`-token blocks. A position its block table does
    /// not reach is computed but not stored (slot -1), as on the CPU backend.
    pub fn build(
        batch: &[BatchSlice<'_>],
        block_size: usize,
        rope: Rope,
    ) -> Result<StepPlan, PlanError> {
        StepPlan::padded(batch, block_size, rope, 0)
    }

    /// As [`StepPlan::build`], with tokens added to make `pad_to` (when more than the batch
    /// has): token 0 at position 0, stored nowhere, seeing nothing, each with a logits row
    /// after the batch's own. A replayed graph computes them and they are never read.
    pub fn padded(
        batch: &[BatchSlice<'_>],
        block_size: usize,
        rope: Rope,
        pad_to: usize,
    ) -> Result<StepPlan, PlanError> {
        let shape = StepShape::of(batch, block_size);
        let real_tokens = shape.num_tokens;
        let num_tokens = real_tokens.max(pad_to);
        let padding = num_tokens - real_tokens;
        let tables_len: usize = batch.iter().map(|s| s.block_table.len()).sum();
        let mut sample_rows = Vec::new();
        let mut t = 0;
        for (i, s) in batch.iter().enumerate() {
            t += s.len;
            if s.samples && s.len > 0 {
                // A draft's tokens each need the model's own token at their position, and the
                // last needs the next one: logits for the last `draft + 1` rows.
                let rows = s.draft.min(s.len - 1) + 1;
                sample_rows.extend((t - rows..t).map(|row| (i, row)));
            }
        }
        let n = sample_rows.len() + padding;
        let hd = rope.head_dim;
        let layout = Layout {
            tokens: 0,
            positions: num_tokens,
            slots: 2 * num_tokens,
            table_start: 3 * num_tokens,
            visible: 4 * num_tokens,
            order: 5 * num_tokens,
            rope: 6 * num_tokens,
            sample_rows: (6 + hd) * num_tokens,
            tables: (6 + hd) * num_tokens + n,
            max_visible: shape.max_visible,
            num_tokens,
            num_samples: n,
            len: (6 + hd) * num_tokens + n + tables_len,
        };
        let index = |v: usize| i32::try_from(v).map_err(|_| PlanError::TooLarge(v));
        let mut packed = vec![0i32; layout.len];
        let mut t = 0;
        let mut table_at = layout.tables;
        for s in batch {
            let table_start = index(table_at - layout.tables)?;
            for (j, &block) in s.block_table.iter().enumerate() {
                packed[table_at + j] = index(block as usize)?;
            }
            table_at += s.block_table.len();
            let order = match SumOrder::for_slice(s) {
                SumOrder::Prompt => 0,
                SumOrder::Decode => 1,
            };
            for pos in s.start..s.start + s.len {
                packed[layout.tokens + t] = s.tokens.get(pos).map_or(0, |&v| v as i32);
                packed[layout.positions + t] = index(pos)?;
                packed[layout.slots + t] = match s.block_table.get(pos / block_size) {
                    Some(&block) => index(block as usize * block_size + pos % block_size)?,
                    None => -1,
                };
                packed[layout.table_start + t] = table_start;
                let reach = s.block_table.len() * block_size;
                packed[layout.visible + t] = index((pos + 1).min(reach))?;
                packed[layout.order + t] = order;
                let angles = &mut packed[layout.rope + t * hd..layout.rope + (t + 1) * hd];
                let mut theta = pos as f32;
                for pair in angles.chunks_exact_mut(2) {
                    pair[0] = theta.cos().to_bits() as i32;
                    pair[1] = theta.sin().to_bits() as i32;
                    theta *= rope.theta_scale;
                }
                t += 1;
            }
        }
        for t in real_tokens..num_tokens {
            packed[layout.slots + t] = -1;
            packed[layout.order + t] = 1;
            for pair in packed[layout.rope + t * hd..layout.rope + (t + 1) * hd].chunks_exact_mut(2)
            {
                pair[0] = 1f32.to_bits() as i32;
            }
        }
        let rows = sample_rows.iter().map(|&(_, row)| row);
        for (j, row) in rows.chain(real_tokens..num_tokens).enumerate() {
            packed[layout.sample_rows + j] = index(row)?;
        }
        Ok(StepPlan {
            packed,
            layout,
            sample_rows,
            decode_only: shape.decode_only,
        })
    }

    /// This plan's shape (its tokens with the padding).
    pub fn shape(&self) -> StepShape {
        StepShape {
            num_tokens: self.layout.num_tokens,
            max_visible: self.layout.max_visible,
            decode_only: self.decode_only,
        }
    }

    pub fn section(&self, start: usize, len: usize) -> &[i32] {
        &self.packed[start..start + len]
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::SamplingParams;

    const ROPE: Rope = Rope {
        head_dim: 4,
        theta_scale: 0.5,
    };

    fn slice<'a>(
        tokens: &'a [u32],
        start: usize,
        len: usize,
        table: &'a [u32],
        params: &'a SamplingParams,
    ) -> BatchSlice<'a> {
        BatchSlice {
            id: 1,
            tokens,
            start,
            len,
            block_table: table,
            samples: true,
            draft: 0,
            params,
            num_output_tokens: 0,
        }
    }

    #[test]
    fn a_prompt_chunk_and_a_decode_token_get_their_slots_and_what_they_see() {
        let p = SamplingParams::default();
        let prompt: Vec<u32> = (100..110).collect();
        let decode: Vec<u32> = (200..206).collect();
        let (t1, t2) = ([7u32, 3, 9], [5u32, 2]);
        // Block size 4: the chunk is positions 4..10, the decode token position 5.
        let chunk = BatchSlice {
            samples: false,
            ..slice(&prompt, 4, 6, &t1, &p)
        };
        // The decode token is the request's first output token.
        let decode_slice = BatchSlice {
            num_output_tokens: 1,
            ..slice(&decode, 5, 1, &t2, &p)
        };
        let plan = StepPlan::build(&[chunk, decode_slice], 4, ROPE).unwrap();
        let l = plan.layout;
        assert_eq!(l.num_tokens, 7);
        assert_eq!(
            plan.section(l.tokens, 7),
            [104, 105, 106, 107, 108, 109, 205]
        );
        assert_eq!(plan.section(l.positions, 7), [4, 5, 6, 7, 8, 9, 5]);
        // Position 4 is in table entry 1 (block 3), slot 3*4+0; position 8 in block 9.
        assert_eq!(plan.section(l.slots, 7), [12, 13, 14, 15, 36, 37, 9]);
        assert_eq!(plan.section(l.table_start, 7), [0, 0, 0, 0, 0, 0, 3]);
        assert_eq!(plan.section(l.visible, 7), [5, 6, 7, 8, 9, 10, 6]);
        assert_eq!(plan.section(l.tables, 5), [7, 3, 9, 5, 2]);
        assert_eq!(l.max_visible, 10);
        // The chunk is a prompt's (its order: one accumulator), the decode token a single
        // token's.
        assert_eq!(plan.section(l.order, 7), [0, 0, 0, 0, 0, 0, 1]);
        // Position 5's angles: 5 rad, then 2.5 rad for the second pair.
        let angles: Vec<f32> = plan
            .section(l.rope + 6 * 4, 4)
            .iter()
            .map(|&b| f32::from_bits(b as u32))
            .collect();
        assert_eq!(angles, [5f32.cos(), 5f32.sin(), 2.5f32.cos(), 2.5f32.sin()]);
        // Only the decode slice samples: its one row, the step's last.
        assert_eq!(plan.sample_rows, [(1, 6)]);
        assert_eq!(plan.section(l.sample_rows, 1), [6]);
        assert_eq!(l.len, plan.packed.len());
    }

    #[test]
    fn a_draft_asks_logits_for_its_tokens_and_the_one_after() {
        let p = SamplingParams::default();
        let tokens: Vec<u32> = (0..12).collect();
        let table = [1u32, 2, 3];
        let drafted = BatchSlice {
            draft: 3,
            ..slice(&tokens, 8, 4, &table, &p)
        };
        let plan = StepPlan::build(&[drafted], 4, ROPE).unwrap();
        assert_eq!(plan.sample_rows, [(0, 0), (0, 1), (0, 2), (0, 3)]);
        // A draft as long as the slice still leaves its first token unverified.
        let whole = BatchSlice {
            draft: 9,
            ..slice(&tokens, 8, 4, &table, &p)
        };
        assert_eq!(
            StepPlan::build(&[whole], 4, ROPE)
                .unwrap()
                .sample_rows
                .len(),
            4
        );
    }

    #[test]
    fn a_position_past_the_block_table_is_computed_but_not_stored() {
        let p = SamplingParams::default();
        let tokens: Vec<u32> = (0..6).collect();
        let table = [4u32];
        let plan = StepPlan::build(&[slice(&tokens, 0, 6, &table, &p)], 4, ROPE).unwrap();
        let l = plan.layout;
        assert_eq!(plan.section(l.slots, 6), [16, 17, 18, 19, -1, -1]);
        // It sees only what the table reaches.
        assert_eq!(plan.section(l.visible, 6), [1, 2, 3, 4, 4, 4]);
    }

    /// The shape read off the batch before planning is the plan's own, padding aside.
    #[test]
    fn a_batchs_shape_is_its_plans() {
        let p = SamplingParams::default();
        let tokens: Vec<u32> = (0..10).collect();
        let table = [3u32, 4];
        let prompt = slice(&tokens, 0, 10, &table, &p);
        let decode = slice(&tokens, 6, 1, &table, &p);
        let empty = slice(&tokens, 0, 0, &[], &p);
        for batch in [
            vec![prompt, decode],
            vec![decode, decode],
            vec![empty, decode],
        ] {
            let shape = StepShape::of(&batch, 4);
            assert_eq!(shape, StepPlan::build(&batch, 4, ROPE).unwrap().shape());
            let padded = StepPlan::padded(&batch, 4, ROPE, 16).unwrap().shape();
            assert_eq!(
                padded,
                StepShape {
                    num_tokens: 16,
                    ..shape
                }
            );
        }
        assert_eq!(StepShape::of(&[prompt, decode], 4).max_visible, 8);
        assert!(StepShape::of(&[decode, decode], 4).decode_only);
        assert!(!StepShape::of(&[empty, decode], 4).decode_only);
    }

    #[test]
    fn padding_adds_tokens_that_are_stored_nowhere_and_see_nothing() {
        let p = SamplingParams::default();
        let tokens: Vec<u32> = (0..6).collect();
        let table = [3u32, 4];
        let decode = BatchSlice {
            num_output_tokens: 1,
            ..slice(&tokens, 5, 1, &table, &p)
        };
        let plan = StepPlan::padded(&[decode], 4, ROPE, 4).unwrap();
        let l = plan.layout;
        assert!(plan.decode_only);
        assert_eq!((l.num_tokens, l.num_samples), (4, 4));
        assert_eq!(plan.section(l.tokens, 4), [5, 0, 0, 0]);
        assert_eq!(plan.section(l.slots, 4), [17, -1, -1, -1]);
        assert_eq!(plan.section(l.visible, 4), [6, 0, 0, 0]);
        // Only the batch's own row is listed; the padding's rows follow it on the device.
        assert_eq!(plan.sample_rows, [(0, 0)]);
        assert_eq!(plan.section(l.sample_rows, 4), [0, 1, 2, 3]);
        // The same step unpadded is the padded one's first token.
        let unpadded = StepPlan::build(&[decode], 4, ROPE).unwrap();
        assert_eq!(unpadded.section(unpadded.layout.slots, 1), [17]);
        // A prompt is not a decode step.
        let prompt = slice(&tokens, 0, 6, &table, &p);
        assert!(!StepPlan::build(&[prompt], 4, ROPE).unwrap().decode_only);
    }

    #[test]
    fn an_empty_step_plans_nothing() {
        let plan = StepPlan::build(&[], 16, ROPE).unwrap();
        assert_eq!(plan.layout.len, 0);
        assert!(plan.sample_rows.is_empty());
    }

    #[test]
    fn a_slot_beyond_32_bits_is_refused_not_wrapped() {
        let p = SamplingParams::default();
        let tokens = [1u32];
        let table = [u32::MAX];
        let err = StepPlan::build(&[slice(&tokens, 0, 1, &table, &p)], 16, ROPE).unwrap_err();
        assert!(matches!(err, PlanError::TooLarge(_)));
    }
}
