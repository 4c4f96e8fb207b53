//! The CUDA backend's forward pass and kernels, run on the CPU by the emulator
//! (`common/emulator.rs`: `kernels.cu` compiled as C++), against the CPU backend on the same
//! model cut to two layers: the same logits bit for bit on prompts, decode steps, a batch of
//! both and a drafted step, the same tokens sampled every way, and the same K/V through
//! export and import. The device runs the
//! same source (compiled by NVRTC with no fused multiply-adds but those written out), so this
//! checks on every machine what `cuda_backend.rs` checks on a GPU. Needs g++ (C++20): without
//! it the tests say so loudly, and fail where `KVGATE_REQUIRE_EMULATOR` is set (the test
//! command sets it).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
#[path = "common/emulator.rs"]
mod emulator;

use common::{default_model, golden, ids, temp_file};
use kvgate_worker::backend::cpu::{CpuBackend, CpuConfig};
use kvgate_worker::backend::cuda::gpu::Gpu;
use kvgate_worker::backend::cuda::{CudaBackend, CudaConfig};
use kvgate_worker::backend::{Backend, BatchSlice};
use kvgate_worker::model::{cut_layers, ModelFile};
use kvgate_worker::SamplingParams;
use std::sync::Arc;

struct Pair {
    cpu: CpuBackend,
    gpu: CudaBackend,
    _model: tempfile::TempPath,
}

/// The emulator for heads of 64 (the model's), or `None`, said loudly, where g++ cannot
/// build it.
fn emulator() -> Option<emulator::Emulator> {
    match emulator::Emulator::build(64) {
        Ok(e) => Some(e),
        Err(e) => {
            let message = format!(
                "the CUDA emulator cannot be built, the emulated CUDA tests did NOT run: {e}"
            );
            assert!(
                std::env::var_os("KVGATE_REQUIRE_EMULATOR").is_none(),
                "{message}"
            );
            eprintln!("SKIPPED: {message}");
            None
        }
    }
}

fn backends(name: &str) -> Option<Pair> {
    let emulator = emulator()?;
    let cut = temp_file(&format!("{name}-2-layers.gguf"));
    cut_layers(&default_model(), &cut, 2).unwrap();
    let model = ModelFile::open(&cut).unwrap();
    let cpu = CpuBackend::load(
        &cut,
        &model,
        &CpuConfig {
            threads: 1,
            kv_cache_bytes: 8 << 20,
            block_size: 16,
        },
    )
    .unwrap();
    let config = CudaConfig {
        gpu: 0,
        memory_utilization: 0.1,
        block_size: 16,
    };
    let gpu = CudaBackend::on(Arc::new(emulator), &cut, &model, &config).unwrap();
    Some(Pair {
        cpu,
        gpu,
        _model: cut,
    })
}

fn slice<'a>(
    tokens: &'a [u32],
    start: usize,
    table: &'a [u32],
    params: &'a SamplingParams,
    num_output_tokens: usize,
) -> BatchSlice<'a> {
    BatchSlice {
        id: 0,
        tokens,
        start,
        len: tokens.len() - start,
        block_table: table,
        samples: true,
        draft: 0,
        params,
        num_output_tokens,
    }
}

/// Both backends' logits rows for `batch`, which must be equal bit for bit.
fn same_logits(pair: &mut Pair, batch: &[BatchSlice<'_>], what: &str) {
    let cpu = pair.cpu.logits(batch);
    let gpu = pair.gpu.logits(batch).unwrap();
    assert_eq!(cpu.len(), gpu.len(), "{what}: rows");
    for (row, ((i, c), (j, g))) in cpu.iter().zip(&gpu).enumerate() {
        assert_eq!(i, j, "{what}: row {row}'s slice");
        let differing = c
            .iter()
            .zip(g)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        let max = c
            .iter()
            .zip(g)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert_eq!(
            differing, 0,
            "{what}: row {row}: {differing} logits differ (max |diff| {max})"
        );
    }
}

#[test]
fn prompts_decode_steps_and_a_batch_of_both_give_the_cpu_backends_bits() {
    let Some(mut pair) = backends("steps") else {
        return;
    };
    let g = golden();
    let greedy = SamplingParams {
        temperature: 0.0,
        ..Default::default()
    };
    // A short prompt, then three decode steps on its cached K/V (the single-token order).
    let mut tokens = ids(&g.cases[19]);
    let prompt_len = tokens.len();
    let table = [1u32, 2];
    same_logits(
        &mut pair,
        &[slice(&tokens, 0, &table, &greedy, 0)],
        "prompt",
    );
    for step in 0..3 {
        let out = pair
            .cpu
            .execute(&[slice(&tokens, 0, &table, &greedy, 0)])
            .unwrap();
        tokens.push(out.sampled[0].token);
        let start = tokens.len() - 1;
        let decode = slice(&tokens, start, &table, &greedy, tokens.len() - prompt_len);
        same_logits(&mut pair, &[decode], &format!("decode step {step}"));
    }
    // A batch: another prompt's second chunk (its first chunk's K/V read from the cache)
    // beside a decode token.
    let other = ids(&g.cases[12]);
    let other_table = [3u32];
    let first_chunk = BatchSlice {
        samples: false,
        len: 4,
        ..slice(&other, 0, &other_table, &greedy, 0)
    };
    same_logits(&mut pair, &[first_chunk], "first chunk");
    let start = tokens.len() - 1;
    let batch = [
        slice(&other, 4, &other_table, &greedy, 0),
        slice(&tokens, start, &table, &greedy, tokens.len() - prompt_len),
    ];
    same_logits(&mut pair, &batch, "prompt chunk beside a decode token");
    // Three decode tokens at once: a step recorded as a graph of four tokens (one of them
    // padding) and replayed.
    let next = pair.cpu.execute(&batch).unwrap().sampled[0].token;
    let mut other = other;
    other.push(next);
    let third = ids(&g.cases[10]);
    let third_table = [6u32];
    same_logits(
        &mut pair,
        &[slice(&third, 0, &third_table, &greedy, 0)],
        "third prompt",
    );
    let mut third = third;
    third.push(
        pair.cpu
            .execute(&[slice(&third, 0, &third_table, &greedy, 0)])
            .unwrap()
            .sampled[0]
            .token,
    );
    for round in 0..2 {
        let decodes = [
            slice(
                &tokens,
                tokens.len() - 1,
                &table,
                &greedy,
                tokens.len() - prompt_len,
            ),
            slice(&other, other.len() - 1, &other_table, &greedy, 1 + round),
            slice(&third, third.len() - 1, &third_table, &greedy, 1 + round),
        ];
        same_logits(
            &mut pair,
            &decodes,
            &format!("three decode tokens, round {round}"),
        );
        let out = pair.cpu.execute(&decodes).unwrap();
        tokens.push(out.sampled[0].token);
        other.push(out.sampled[1].token);
        third.push(out.sampled[2].token);
    }
    // The decode steps ran as recorded graphs (the one-token graph went when the four-row
    // step grew the buffers its addresses pointed into; the four-token one is kept).
    assert_eq!(pair.gpu.graphs(), 1);
}

#[test]
fn a_drafted_step_and_sampling_every_way_give_the_cpu_backends_tokens() {
    use kvgate_worker::backend::cuda::TOP_K_MAX;

    let Some(mut pair) = backends("draft") else {
        return;
    };
    let prompt = ids(&golden().cases[10]);
    let greedy = SamplingParams {
        temperature: 0.0,
        ..Default::default()
    };
    let mut tokens = prompt.clone();
    tokens.extend([42, 1337, 7]);
    let table = [5u32];
    let drafted = BatchSlice {
        draft: 3,
        ..slice(&tokens, 0, &table, &greedy, 3)
    };
    same_logits(&mut pair, &[drafted], "drafted step");
    let cpu = pair.cpu.execute(&[drafted]).unwrap();
    let gpu = pair.gpu.execute(&[drafted]).unwrap();
    assert_eq!(cpu.sampled, gpu.sampled);
    // A batch that samples every way at once: greedy, top-k small and at the device's limit
    // (drawn from the device's best k), top-k beyond it, top-p alone and log-probabilities
    // (drawn from the whole row).
    let params = [
        greedy,
        SamplingParams {
            temperature: 0.7,
            top_k: 5,
            ..Default::default()
        },
        SamplingParams {
            temperature: 1.3,
            top_k: 50,
            top_p: 0.9,
            ..Default::default()
        },
        SamplingParams {
            temperature: 2.0,
            top_k: TOP_K_MAX as u32,
            ..Default::default()
        },
        SamplingParams {
            temperature: 1.0,
            top_k: TOP_K_MAX as u32 + 1,
            ..Default::default()
        },
        SamplingParams {
            temperature: 0.8,
            top_p: 0.8,
            ..Default::default()
        },
        SamplingParams {
            temperature: 0.9,
            top_k: 20,
            seed: Some(3),
            logprobs: Some(2),
            ..Default::default()
        },
    ];
    let prompts: Vec<Vec<u32>> = (0..params.len())
        .map(|i| ids(&golden().cases[i])[..6].to_vec())
        .collect();
    let tables: Vec<[u32; 1]> = (0..params.len()).map(|i| [10 + i as u32]).collect();
    let batch: Vec<BatchSlice<'_>> = (0..params.len())
        .map(|i| BatchSlice {
            id: 100 + i as u64,
            ..slice(&prompts[i], 0, &tables[i], &params[i], i)
        })
        .collect();
    assert_eq!(
        pair.cpu.execute(&batch).unwrap().sampled,
        pair.gpu.execute(&batch).unwrap().sampled
    );
}

#[test]
fn a_block_moved_through_export_and_import_holds_the_cpu_backends_k_and_v() {
    let Some(mut pair) = backends("blocks") else {
        return;
    };
    let prompt: Vec<u32> = ids(&golden().cases[1]).into_iter().take(16).collect();
    let params = SamplingParams::default();
    let step = BatchSlice {
        samples: false,
        ..slice(&prompt, 0, &[2], &params, 0)
    };
    pair.cpu.execute(&[step]).unwrap();
    pair.gpu.execute(&[step]).unwrap();
    // The same K/V, in the same export format, both ways round.
    let from_cpu = pair.cpu.export_block(2).unwrap();
    assert_eq!(pair.gpu.export_block(2).unwrap(), from_cpu);
    pair.gpu.import_block(4, &from_cpu).unwrap();
    assert_eq!(pair.gpu.export_block(4).unwrap(), from_cpu);
    assert!(pair.gpu.import_block(4, &from_cpu[2..]).is_err());
    assert!(pair.gpu.export_block(0).is_none());
}

#[test]
fn settings_and_memory_the_backend_cannot_use_are_one_line_errors() {
    let Some(emulator) = emulator() else { return };
    let gpu: Arc<dyn Gpu> = Arc::new(emulator);
    let model = ModelFile::open(&default_model()).unwrap();
    let config = |memory_utilization: f64, block_size: usize| CudaConfig {
        gpu: 0,
        memory_utilization,
        block_size,
    };
    let error = |c: CudaConfig| {
        CudaBackend::on(Arc::clone(&gpu), &default_model(), &model, &c)
            .err()
            .unwrap()
    };
    for utilization in [0.0, -0.5, 1.5, f64::NAN] {
        let e = error(config(utilization, 16));
        assert!(e.contains("--gpu-memory-utilization"), "{e}");
    }
    assert!(error(config(0.5, 0)).contains("--block-size"));
    // 1 % of the emulator's 16 GiB is less than the step buffers' reserve.
    let e = error(config(0.01, 16));
    assert!(e.contains("no device memory left for the KV cache"), "{e}");
    assert!(!e.contains('\n'), "{e}");
}

/// The matrix-product kernel alone, on every weight format the backend takes (this model has
/// no Q4_0 matrix), against the CPU backend's product: a row count that leaves lanes idle,
/// two token tiles, and adding into what the output holds.
#[test]
fn every_weight_format_multiplies_to_the_cpu_backends_bits() {
    use kvgate_worker::backend::cpu::acts::Activations;
    use kvgate_worker::backend::cpu::dot::Isa;
    use kvgate_worker::backend::cpu::matmul::Matmul;
    use kvgate_worker::backend::cpu::quant::WeightType;
    use kvgate_worker::backend::cpu::team::Team;
    use kvgate_worker::backend::cpu::weights::{block_scales, Matrix, MatrixData};
    use kvgate_worker::backend::cuda::gpu::{Arg, Buffer};
    use kvgate_worker::backend::cuda::weights::product;

    let Some(emulator) = emulator() else { return };
    let gpu: Arc<dyn Gpu> = Arc::new(emulator);
    let (rows, cols, tokens) = (40usize, 96usize, 11usize);
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1);
        (state >> 33) as u32
    };
    let team = Team::new(1).unwrap();
    let isa = Isa::detect();
    for kind in [WeightType::Q4_0, WeightType::Q4_1, WeightType::Q8_0] {
        // Blocks with sane f16 scales (and Q4_1 offsets) and random values.
        let size = kind.row_bytes(32);
        let header = if kind == WeightType::Q4_1 { 4 } else { 2 };
        let mut bytes = Vec::new();
        for _ in 0..rows * cols / 32 {
            let d = half::f16::from_f32(0.01 + (next() % 1000) as f32 * 1e-4);
            bytes.extend(d.to_le_bytes());
            if header == 4 {
                let m = half::f16::from_f32((next() % 1000) as f32 * 1e-3 - 0.5);
                bytes.extend(m.to_le_bytes());
            }
            bytes.extend((header..size).map(|_| next() as u8));
        }
        let (d, m) = block_scales(kind, &bytes);
        let matrix = Matrix {
            rows,
            cols,
            data: MatrixData::Quantized {
                kind,
                bytes,
                row_bytes: kind.row_bytes(cols),
                d,
                m,
            },
        };
        let xs: Vec<f32> = (0..tokens * cols)
            .map(|_| (next() % 6000) as f32 * 1e-3 - 3.0)
            .collect();
        let mut acts = Activations::default();
        acts.reserve(tokens);
        for t in 0..tokens {
            acts.rows[t].quantize(&xs[t * cols..(t + 1) * cols]);
        }
        acts.pack(tokens, isa.tiles_groups(), &team);
        let mut cpu = vec![0f32; tokens * rows];
        Matmul { isa, team: &team }.run(&matrix, &acts, &xs, tokens, &mut cpu, &mut Vec::new());

        let device = product(&gpu, "test", &[&matrix]).unwrap();
        let part = &device.parts[0];
        let codes: Vec<i8> = acts.rows[..tokens]
            .iter()
            .flat_map(|r| r.q.clone())
            .collect();
        let scales: Vec<f32> = acts.rows[..tokens]
            .iter()
            .flat_map(|r| r.d.clone())
            .collect();
        let sums: Vec<f32> = acts.rows[..tokens]
            .iter()
            .flat_map(|r| r.s.clone())
            .collect();
        let (aq, ad, asum) = (
            Buffer::from(&gpu, &codes).unwrap(),
            Buffer::from(&gpu, &scales).unwrap(),
            Buffer::from(&gpu, &sums).unwrap(),
        );
        let out = Buffer::zeros(&gpu, 4 * tokens * rows).unwrap();
        let multiply = |accumulate: i32| {
            let args = [
                Arg::Ptr(part.qs.ptr()),
                Arg::Ptr(part.d.ptr()),
                Arg::Ptr(part.m.ptr()),
                Arg::I32(part.kind),
                Arg::I32(rows as i32),
                Arg::I32(cols as i32),
                Arg::Ptr(aq.ptr()),
                Arg::Ptr(ad.ptr()),
                Arg::Ptr(asum.ptr()),
                Arg::I32(tokens as i32),
                Arg::Ptr(out.ptr()),
                Arg::I32(rows as i32),
                Arg::I32(accumulate),
            ];
            let grid = (rows.div_ceil(16) as u32, tokens.div_ceil(8) as u32, 1);
            gpu.launch("matmul_q", grid, 128, &args).unwrap();
            out.read::<f32>(0, tokens * rows).unwrap()
        };
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&multiply(0)), bits(&cpu), "{kind:?}");
        let doubled: Vec<f32> = cpu.iter().map(|v| v + v).collect();
        assert_eq!(
            bits(&multiply(1)),
            bits(&doubled),
            "{kind:?}, added into the output"
        );
    }
}

/// The top-k kernel alone on rows made to be hard: ties across the cut, -0 and +0, infinities,
/// a temperature that makes distinct logits equal, k of 1, of the row and of `TOP_K_MAX`.
/// Each row's picks are exactly the host's best k by value over temperature, then lower id.
#[test]
fn the_top_k_kernel_picks_the_hosts_best_k() {
    use kvgate_worker::backend::cuda::gpu::{Arg, Buffer};
    use kvgate_worker::backend::cuda::TOP_K_MAX;

    let Some(emulator) = emulator() else { return };
    let gpu: Arc<dyn Gpu> = Arc::new(emulator);
    let vocab = 3000usize;
    let rows: Vec<(Vec<f32>, usize, f32)> = vec![
        // Thirty values, each a hundred times: every cut inside a tie.
        (
            (0..vocab).map(|i| ((i * 7) % 30) as f32).collect(),
            250,
            1.0,
        ),
        (
            (0..vocab)
                .map(|i| match i % 5 {
                    0 => -0.0,
                    1 => 0.0,
                    2 => f32::NEG_INFINITY,
                    3 => -(i as f32),
                    _ => i as f32 * 1e-3,
                })
                .collect(),
            TOP_K_MAX,
            0.7,
        ),
        ((0..vocab).map(|i| 1.0 + i as f32 * 1e-9).collect(), 17, 3.0),
        (
            (0..vocab).map(|i| (i as f32 * 0.37).sin()).collect(),
            1,
            0.5,
        ),
        ((0..vocab).map(|i| (i as f32).cos()).collect(), 0, 1.0),
        ((0..vocab).map(|i| (i % 3) as f32).collect(), vocab, 2.0),
    ];
    let n = rows.len();
    let logits: Vec<f32> = rows.iter().flat_map(|r| r.0.clone()).collect();
    let mut choice: Vec<u32> = rows.iter().map(|r| r.1 as u32).collect();
    choice.extend(rows.iter().map(|r| r.2.to_bits()));
    let logits = Buffer::from(&gpu, &logits).unwrap();
    let choice = Buffer::from(&gpu, &choice).unwrap();
    let ids = Buffer::zeros(&gpu, 4 * n * TOP_K_MAX).unwrap();
    let values = Buffer::zeros(&gpu, 4 * n * TOP_K_MAX).unwrap();
    gpu.launch(
        "top_k",
        (n as u32, 1, 1),
        128,
        &[
            Arg::Ptr(logits.ptr()),
            Arg::I32(vocab as i32),
            Arg::Ptr(choice.ptr()),
            Arg::Ptr(choice.at::<f32>(n)),
            Arg::Ptr(ids.ptr()),
            Arg::Ptr(values.ptr()),
        ],
    )
    .unwrap();
    let ids: Vec<u32> = ids.read(0, n * TOP_K_MAX).unwrap();
    let values: Vec<f32> = values.read(0, n * TOP_K_MAX).unwrap();
    for (r, (row, k, t)) in rows.iter().enumerate() {
        let k = (*k).min(TOP_K_MAX);
        let at = r * TOP_K_MAX;
        let mut device: Vec<(u32, u32)> = (at..at + k)
            .map(|i| (ids[i], values[i].to_bits()))
            .collect();
        device.sort_unstable();
        let mut host: Vec<(u32, f32)> = (0..vocab as u32).map(|i| (i, row[i as usize])).collect();
        host.sort_by(|a, b| (b.1 / t).total_cmp(&(a.1 / t)).then(a.0.cmp(&b.0)));
        let mut host: Vec<(u32, u32)> = host[..k].iter().map(|&(i, v)| (i, v.to_bits())).collect();
        host.sort_unstable();
        assert_eq!(device, host, "row {r}: k {k}, temperature {t}");
    }
}

/// The tests build their emulators at once; each build writes and loads a library of its
/// own, never one another build is still writing or has already removed.
#[test]
fn every_build_has_a_library_file_of_its_own() {
    let first = emulator::Emulator::library_path(64);
    let second = emulator::Emulator::library_path(64);
    assert_ne!(first, second);
}
