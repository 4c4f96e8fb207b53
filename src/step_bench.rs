//! `kvgate step-bench`: the CUDA backend's steps timed directly (no engine, no HTTP): greedy
//! decode steps at several batch sizes, sampled ones at one, and one long prompt, with the
//! share of each decode step the host spends enqueueing launches and the bandwidth roofline
//! beside each figure.

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
    /// Batch size of the sampled decode steps timed after the greedy ones (0: none): top-k 50,
    /// whose best tokens the device picks, and top-p 0.9, whose logits rows come to the host.
    #[arg(long, default_value_t = 64)]
    sampled_batch: usize,
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
    let top_k = SamplingParams {
        temperature: 0.8,
        top_k: 50,
        ..Default::default()
    };
    let top_p = SamplingParams {
        temperature: 0.8,
        top_p: 0.9,
        ..Default::default()
    };
    let kv_bytes_per_token = p.layers * 2 * p.kv_heads * p.head_dim * 2;
    let weights = gpu.bytes_per_step();
    let sampled = [("top-k 50", &top_k), ("top-p 0.9", &top_p)];
    let runs = args
        .batches
        .iter()
        .map(|&batch| (batch, "greedy", &greedy))
        .chain(
            sampled
                .iter()
                .filter(|_| args.sampled_batch > 0)
                .map(|&(name, params)| (args.sampled_batch, name, params)),
        );
    let mut rows = Vec::new();
    for (batch, sampling, params) in runs {
        let (median, enqueue_share) = time_decode(&mut gpu, batch, params, &args, p.vocab_size)?;
        let context = args.context + args.steps / 2;
        let bytes = weights + batch * context * kv_bytes_per_token;
        let roofline = bytes as f64 / (args.bandwidth_tb_s * 1e12);
        rows.push(serde_json::json!({
            "batch": batch,
            "sampling": sampling,
            "step_us": median * 1e6,
            "tokens_per_s": batch as f64 / median,
            "enqueue_share": enqueue_share,
            "bytes_per_step": bytes,
            "roofline_us": roofline * 1e6,
            "roofline_share": roofline / median,
        }));
        println!(
            "decode batch {batch:3} {sampling:9}: {:8.0} tok/s, step {:7.1} us, enqueue {:3.0} % of it, roofline {:6.1} us ({:4.1} % of the step)",
            batch as f64 / median,
            median * 1e6,
            enqueue_share * 100.0,
            roofline * 1e6,
            roofline / median * 100.0
        );
    }
    // One long prompt in one step, the best of three.
    let tokens = kvgate_worker::backend::timing::filler(args.prefill, p.vocab_size);
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
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&out).unwrap_or_default())
            .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}

/// KV blocks of this many tokens.
#[cfg(feature = "cuda")]
const BLOCK: usize = 16;

/// `batch` sequences of `args.context` prompt tokens decoded `args.steps` steps with
/// `params`: the median step's seconds, and the share of one step the host spends
/// enqueueing it.
#[cfg(feature = "cuda")]
fn time_decode(
    gpu: &mut kvgate_worker::backend::cuda::CudaBackend,
    batch: usize,
    params: &kvgate_worker::SamplingParams,
    args: &StepBenchArgs,
    vocab: usize,
) -> Result<(f64, f64), String> {
    use kvgate_worker::backend::{Backend, BatchSlice};
    use std::time::Instant;

    let vocab = vocab as u32;
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
    let mut step_s = Vec::new();
    // Step 0 computes the prompts (untimed); the others decode one token per sequence.
    for step in 0..=args.steps + 1 {
        let batch_slices: Vec<BatchSlice<'_>> = seqs
            .iter()
            .enumerate()
            .map(|(i, (t, table))| {
                let start = if step == 0 { 0 } else { t.len() - 1 };
                BatchSlice {
                    id: i as u64,
                    tokens: t,
                    start,
                    len: t.len() - start,
                    block_table: table,
                    samples: true,
                    draft: 0,
                    params,
                    num_output_tokens: t.len() - args.context,
                }
            })
            .collect();
        let started = Instant::now();
        if step == args.steps + 1 {
            // The last step split: enqueueing alone, then the device's remaining work.
            gpu.enqueue(&batch_slices)?;
            let enqueued = started.elapsed().as_secs_f64();
            gpu.synchronize()?;
            let enqueue_share = enqueued / started.elapsed().as_secs_f64();
            step_s.sort_by(f64::total_cmp);
            let median = step_s.get(step_s.len() / 2).copied();
            return Ok((median.ok_or("--steps must be at least 1")?, enqueue_share));
        }
        let out = gpu.execute(&batch_slices).map_err(|e| e.to_string())?;
        if step > 0 {
            step_s.push(started.elapsed().as_secs_f64());
        }
        drop(batch_slices);
        for (s, (tokens, _)) in out.sampled.iter().zip(seqs.iter_mut()) {
            tokens.push(s.token);
        }
    }
    Err("no decode step was timed".into())
}
