//! GPU figures through NVML (loaded at run time: on machines without an NVIDIA driver the
//! agent says so once and its reports carry no GPU figures).

use kvgate_protocol::telemetry::GpuStats;
use nvml_wrapper::enum_wrappers::device::TemperatureSensor;
use nvml_wrapper::Nvml;

pub struct Gpus {
    nvml: Option<Nvml>,
    /// The GPUs to report (`None`: all the driver shows).
    indices: Option<Vec<u32>>,
}

impl Gpus {
    /// Opens NVML for the GPUs `indices` (all when `None`).
    pub fn open(indices: Option<Vec<u32>>) -> Gpus {
        let nvml = match Nvml::init() {
            Ok(n) => Some(n),
            Err(e) => {
                tracing::info!(error = %e, "NVML is not available: reports carry no GPU figures");
                None
            }
        };
        Gpus { nvml, indices }
    }

    #[cfg(test)]
    fn available(&self) -> bool {
        self.nvml.is_some()
    }

    /// The current figures of each GPU (a GPU whose figures cannot be read is left out, and
    /// the reason logged at debug level).
    pub fn sample(&self) -> Vec<GpuStats> {
        let Some(nvml) = &self.nvml else {
            return Vec::new();
        };
        let indices = match &self.indices {
            Some(i) => i.clone(),
            None => (0..nvml.device_count().unwrap_or(0)).collect(),
        };
        indices
            .into_iter()
            .filter_map(|index| {
                let read = || -> Result<GpuStats, nvml_wrapper::error::NvmlError> {
                    let d = nvml.device_by_index(index)?;
                    let memory = d.memory_info()?;
                    let utilization = d.utilization_rates()?;
                    Ok(GpuStats {
                        index,
                        name: d.name()?,
                        memory_used_bytes: memory.used,
                        memory_total_bytes: memory.total,
                        utilization_percent: utilization.gpu,
                        temperature_c: d.temperature(TemperatureSensor::Gpu).ok(),
                    })
                };
                read()
                    .map_err(|e| tracing::debug!(index, error = %e, "cannot read GPU figures"))
                    .ok()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where a driver is present, every visible GPU reports its memory; where none is, this
    /// says so loudly (it cannot test NVML here).
    #[test]
    fn samples_every_visible_gpu_or_none() {
        let gpus = Gpus::open(None);
        let stats = gpus.sample();
        if !gpus.available() {
            eprintln!(
                "\n\n*** SKIPPED: no NVIDIA driver here, NVML sampling was not exercised ***\n\n"
            );
            assert!(stats.is_empty());
            return;
        }
        assert!(!stats.is_empty(), "NVML is up but shows no GPU");
        for s in &stats {
            assert!(
                s.memory_total_bytes > 0 && s.memory_used_bytes <= s.memory_total_bytes,
                "{s:?}"
            );
            assert!(s.utilization_percent <= 100, "{s:?}");
        }
    }
}
