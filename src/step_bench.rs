//! `kvgate step-bench`: the CUDA backend's steps timed directly (no engine, no HTTP): decode
//! steps at several batch sizes and one long prompt, with the share of each decode step the
//! host spends enqueueing launches and the bandwidth roofline beside each figure.

use clap::Args;
use std::path::PathBuf;

#[derive(Args)]
pub struct StepBenchArgs {
    #[arg(long, default_value = crate::DEFAULT_MODEL)]
    model: PathBuf,
    #[arg(long, default_value_t = 0)]
    gpu: usize,
    /// Decode batch sizes (sequences, one token each per step).
    #[arg(long, value_delimiter = ',', default_value = "1,16,64,256")]
    batches: Vec<usize>,
    /// Prompt tokens each decoding sequence holds before its steps.
    #[arg(long, default_value_t = 128)]
    context: usize,
    /// Decode steps timed per batch size.
    #[arg(long, default_value_t = 32)]
    steps: usize,
    /// Tokens of the prompt timed as one prefill step.
    #[arg(long, default_value_t = 4096)]
    prefill: usize,
    /// The device's memory bandwidth for the roofline, in TB/s (H200: 4.8).
    #[arg(long, default_value_t = 4.8)]
    bandwidth_tb_s: f64,
    /// Also write the figures as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[cfg(not(feature = "cuda"))]
pub fn run(_: StepBenchArgs) -> Result<(), String> {
    Err(kvgate_worker::backend::cuda::unavailable()
        .unwrap_or("no CUDA backend")
        .into())
}

#[cfg(feature = "cuda")]
pub fn run(args: StepBenchArgs) -> Result<(), String> {
    use kvgate_worker::backend::cuda::{CudaBackend, CudaConfig};
    use kvgate_worker::backend::{Backend, BatchSlice};
    use kvgate_worker::model::ModelFile;
    use kvgate_worker::SamplingParams;
    use std::time::Instant;

    const BLOCK: usize = 16;
    let model =
        ModelFile::open(&args.model).map_err(|e| format!("{}: {e}", args.model.display()))?;
    let p = model.params.clone();
    let config = CudaConfig {
        gpu: args.gpu,
        memory_utilization: 0.5,
        block_size: BLOCK,
    };
    let mut gpu = CudaBackend::load(&args.model, &model, &config)?;
    println!("device: {}", gpu.describe());
    let greedy = SamplingParams {
        temperature: 0.0,
        ..Default::default()
    };
    let vocab = p.vocab_size as u32;
    let kv_bytes_per_token = p.layers * 2 * p.kv_heads * p.head_dim * 2;
    let weights = gpu.bytes_per_step();
    let mut rows = Vec::new();
    for &batch in &args.batches {
        let total = args.context + args.steps + 2;
        let per_seq = total.div_ceil(BLOCK) as u32;
        let mut seqs: Vec<(Vec<u32>, Vec<u32>)> = (0..batch)
            .map(|i| {
                let tokens = (0..args.context as u32)
                    .map(|j| (j * 7919 + i as u32 * 31 + 100) % vocab)
                    .collect();
                let table = (1 + i as u32 * per_seq..1 + (i as u32 + 1) * per_seq).collect();
                (tokens, table)
            })
            .collect();
        let prefill: Vec<BatchSlice<'_>> = seqs
            .iter()
            .enumerate()
            .map(|(i, (t, table))| BatchSlice {
                id: i as u64,
                tokens: t,
                start: 0,
                len: t.len(),
                block_table: table,
                samples: true,
                draft: 0,
                params: &greedy,
                num_output_tokens: 0,
            })
            .collect();
        let first = gpu.execute(&prefill).map_err(|e| e.to_string())?;
        for (s, (tokens, _)) in first.sampled.iter().zip(seqs.iter_mut()) {
            tokens.push(s.token);
        }
        let (mut step_s, mut enqueue_share) = (Vec::new(), Vec::new());
        for step in 0..=args.steps {
            let batch_slices: Vec<BatchSlice<'_>> = seqs
                .iter()
                .enumerate()
                .map(|(i, (t, table))| BatchSlice {
                    id: i as u64,
                    tokens: t,
                    start: t.len() - 1,
                    len: 1,
                    block_table: table,
                    samples: true,
                    draft: 0,
                    params: &greedy,
                    num_output_tokens: t.len() - args.context,
                })
                .collect();
            let started = Instant::now();
            if step == args.steps {
                // The last step split: enqueueing alone, then the device's remaining work.
                gpu.enqueue(&batch_slices)?;
                let enqueued = started.elapsed().as_secs_f64();
                gpu.synchronize()?;
                enqueue_share.push(enqueued / started.elapsed().as_secs_f64());
                break;
            }
            let out = gpu.execute(&batch_slices).map_err(|e| e.to_string())?;
            step_s.push(started.elapsed().as_secs_f64());
            drop(batch_slices);
            for (s, (tokens, _)) in out.sampled.iter().zip(seqs.iter_mut()) {
                tokens.push(s.token);
            }
        }
        step_s.sort_by(f64::total_cmp);
        let median = step_s[step_s.len() / 2];
        let context = args.context + args.steps / 2;
        let bytes = weights + batch * context * kv_bytes_per_token;
        let roofline = bytes as f64 / (args.bandwidth_tb_s * 1e12);
        let row = serde_json::json!({
            "batch": batch,
            "step_us": median * 1e6,
            "tokens_per_s": batch as f64 / median,
            "enqueue_share": enqueue_share[0],
            "bytes_per_step": bytes,
            "roofline_us": roofline * 1e6,
            "roofline_share": roofline / median,
        });
        println!(
            "decode batch {batch:3}: {:8.0} tok/s, step {:7.1} us, enqueue {:3.0} % of it, roofline {:6.1} us ({:4.1} % of the step)",
            batch as f64 / median,
            median * 1e6,
            enqueue_share[0] * 100.0,
            roofline * 1e6,
            roofline / median * 100.0
        );
        rows.push(row);
    }
    // One long prompt in one step, the best of three.
    let tokens: Vec<u32> = (0..args.prefill as u32)
        .map(|j| (j * 7919 + 100) % vocab)
        .collect();
    let table: Vec<u32> = (1..=args.prefill.div_ceil(BLOCK) as u32).collect();
    let slice = BatchSlice {
        id: 0,
        tokens: &tokens,
        start: 0,
        len: tokens.len(),
        block_table: &table,
        samples: true,
        draft: 0,
        params: &greedy,
        num_output_tokens: 0,
    };
    let mut best = f64::MAX;
    for _ in 0..3 {
        let started = Instant::now();
        gpu.execute(&[slice]).map_err(|e| e.to_string())?;
        best = best.min(started.elapsed().as_secs_f64());
    }
    println!(
        "prefill {} tokens: {:.0} tok/s ({:.2} ms)",
        args.prefill,
        args.prefill as f64 / best,
        best * 1e3
    );
    let out = serde_json::json!({
        "device": gpu.describe(),
        "model": args.model.display().to_string(),
        "weights_bytes_per_step": weights,
        "decode": rows,
        "prefill": {"tokens": args.prefill, "tokens_per_s": args.prefill as f64 / best, "step_ms": best * 1e3},
    });
    if let Some(path) = args.json {
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&out).unwrap_or_default(),
        )
        .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}
