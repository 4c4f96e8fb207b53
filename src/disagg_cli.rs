//! `kvgate worker`'s prefill/decode flags.

use kvgate_worker::server::disagg::{DisaggConfig, Role};
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

/// The host tier a decode role gets when `--kv-offload-mib` is not given: pulled blocks land
/// there.
const DECODE_HOST_TIER_MIB: usize = 1024;

#[derive(clap::Args, Clone, Debug)]
pub struct DisaggArgs {
    /// Prefill/decode disaggregation: `prefill` computes prompts and serves their K/V blocks
    /// to decode workers, `decode` pulls them before generating, `both` does either; every
    /// role still serves whole requests. Legs are asked for with vLLM's `kv_transfer_params`.
    #[arg(long)]
    pub role: Option<Role>,
    /// Prefill roles: the port decode workers pull blocks from (0: any free port; the
    /// prefill leg's response says which).
    #[arg(long, default_value_t = 0, requires = "role")]
    pub kv_transfer_port: u16,
    /// Decode roles: how long a pull may take before the rest of the prompt is computed here.
    #[arg(long, default_value_t = 5000, requires = "role")]
    pub kv_transfer_timeout_ms: u64,
    /// Prefill roles: MiB of finished prompts' blocks kept for their pulls (oldest dropped
    /// first).
    #[arg(long, default_value_t = 1024, requires = "role")]
    pub kv_transfer_mib: usize,
    /// Prefill roles: seconds a prompt's blocks wait for their pull.
    #[arg(long, default_value_t = 60, requires = "role")]
    pub kv_transfer_ttl_s: u64,
}

impl DisaggArgs {
    /// The roles' settings (listening on `host`), and the host tier in MiB: a decode role
    /// needs one, `DECODE_HOST_TIER_MIB` unless `offload_mib` is set.
    pub fn config(
        &self,
        host: IpAddr,
        offload_mib: usize,
    ) -> Result<(Option<DisaggConfig>, usize), String> {
        let Some(role) = self.role else {
            return Ok((None, offload_mib));
        };
        if self.kv_transfer_timeout_ms == 0 || self.kv_transfer_ttl_s == 0 {
            return Err(
                "--kv-transfer-timeout-ms and --kv-transfer-ttl-s must be at least 1".into(),
            );
        }
        let store_bytes = self
            .kv_transfer_mib
            .checked_mul(1 << 20)
            .ok_or("--kv-transfer-mib is too large")?;
        let offload_mib = match (role.decodes(), offload_mib) {
            (true, 0) => DECODE_HOST_TIER_MIB,
            (_, mib) => mib,
        };
        let config = DisaggConfig {
            role,
            transfer_addr: SocketAddr::new(host, self.kv_transfer_port),
            pull_timeout: Duration::from_millis(self.kv_transfer_timeout_ms),
            store_bytes,
            store_ttl: Duration::from_secs(self.kv_transfer_ttl_s),
        };
        Ok((Some(config), offload_mib))
    }
}
