//! The CPU backend: SmolLM2 (Llama family) from GGUF with quantised kernels.

pub mod dot;
pub mod quant;
